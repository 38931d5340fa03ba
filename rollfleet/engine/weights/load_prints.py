"""Fingerprints taken right after a weight update copied into the parameters, so sync verification
samples no tensor again.

Only parameters that are their checkpoint tensor and unsharded (tp=1, not fused experts) are
sampled: their sample is gathered on the device at load and copied to the host and hashed when
asked. Anything else that changes weights (a LoRA merge, a release) forgets them all.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from rollfleet.wire.fingerprint import Fingerprints, sample_view


class LoadPrints:
    def __init__(self, plain_to_param: dict[str, str], checkpoint_shapes: dict[str, tuple[int, ...]]):
        self.plain_to_param = plain_to_param  # checkpoint name -> parameter that IS that tensor
        self.checkpoint_shapes = checkpoint_shapes
        # sample views are made once: a view of a parameter's storage stays valid through updates,
        # merges and release/resume
        self._sample_views: dict[str, torch.Tensor | None] = {}
        self.forget()

    @property
    def samples(self) -> int:
        return self._prints.samples

    @property
    def pending(self) -> int:
        """Samples gathered on the device and not hashed yet."""
        return self._prints.pending

    def forget(self) -> None:
        self._prints, self._digests = Fingerprints(), {}

    def take(self, names, params: dict[str, torch.Tensor]) -> None:
        """Sample the parameters an update just wrote (`params`: the base parameters)."""
        for name in names:
            sample = self._sample(name, params)
            if sample is not None:
                self._prints.add_sample(name, self.checkpoint_shapes[name], sample)
            else:
                self._digests.pop(name, None)  # computed from the parameter when asked
        self._prints.flush()
        if self._prints.pending > 2 * len(self.plain_to_param):  # nobody asked for a while
            self.digests()  # bounds the samples held on the device

    def digests(self) -> dict[str, str]:
        """Checkpoint name -> fingerprint, of every tensor sampled since the last `forget`."""
        self._digests.update(self._prints.digests())  # waits for the device's pending copies
        return self._digests

    def _sample(self, name: str, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if name not in self._sample_views:
            param = params.get(self.plain_to_param.get(name, ""))
            plain = param is not None and not isinstance(param, DTensor)
            self._sample_views[name] = sample_view(param.data, self._prints.samples) if plain else None
        return self._sample_views[name]
