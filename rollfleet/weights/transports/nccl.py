"""nccl (disaggregated): broadcast from the sender (group rank 0) to every engine rank.

The group is the sender plus every engine rank (rollfleet.layout.weight_update_group: world_size =
1 + sum(tp*pp), the k-th target joins at rank_offset = 1 + the ranks of the targets before it).
NCCL on GPU, gloo on CPU (the same code runs in CPU tests). Per call (whole decoder layers, about
bucket_mb): announce it to every engine (/update_weights_from_distributed, "flattened_bucket": the
names, dtypes and shapes of its tensors, in order) and broadcast their bytes as one uint8 tensor
without waiting for it: call k+1 is packed while call k is on the wire (two reusable buffers, kept
while connected: the sender's extra memory is two buckets).
An engine must run the calls in broadcast order, and two requests in flight may reach it in either
order. Engines that advertise `rollfleet_ordered_weight_calls` (the embedded one) take numbered
calls and run them in number order (rollfleet.engine.weights.call_order), so call k+1 is announced while
call k is on the wire. Others (SGLang) get call k+1 once every engine has answered call k (an
engine answers when its receive is posted). A join that does not complete in time fails with the
group, the ranks and the address named, instead of hanging. Engines with weight-update sessions get
one around the calls; its end commits the update and the version.
"""

from __future__ import annotations

import secrets
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from rollfleet.layout import weight_update_group
from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports.base import SyncReport, Transport, iter_calls, register, timed
from rollfleet.weights.transports.staging import DoubleBuffer, aligned_order, call_bytes, pack_bytes, wait_all
from rollfleet.wire.buckets import dtype_name
from rollfleet.wire.group import join_weight_update_group
from rollfleet.wire.handoffs import prompt_handoffs
from rollfleet.wire.net import free_port

GROUP_NAME = "rollfleet_weight_update"
CALLS_AHEAD = 2  # announced calls an ordered engine may hold (each may allocate a receive buffer)


@register
class NcclTransport(Transport):
    name = "nccl"

    def __init__(self, spec, targets, *, device: str | None = None, **kwargs):
        super().__init__(spec, targets, **kwargs)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        offsets, self.world_size = weight_update_group([t.num_ranks for t in targets])
        if offsets != [t.rank_offset for t in targets]:
            raise ValueError(
                f"targets' rank_offset={[t.rank_offset for t in targets]}: a weight-update group of these engines "
                f"numbers them {offsets} (sender 0, then each engine's tp*pp ranks in order); build the targets "
                "with rollfleet.layout.weight_update_group"
            )
        self.group = None
        self.broken = False  # a send failed: the group is aborted at disconnect, not destroyed
        self.calls_ahead = 1  # set at connect(), from what the engines support
        # Kept for the transport's life: NCCL releases a finished broadcast's tensors from its own
        # thread, later, so buffers made per sync overlapped the next sync's (three buckets seen)
        self.buffers = DoubleBuffer(self.spec.bucket_bytes)

    def connect(self) -> None:
        infos = self._server_infos()  # before the group: an unsupported engine is refused, not joined
        port = self.spec.master_port or free_port()
        where = f"{self.spec.master_address}:{port}"
        joins = self._each(
            "init_weights_update_group",
            lambda t: (
                (self.spec.master_address, port, t.rank_offset, self.world_size),
                {"group_name": GROUP_NAME, "backend": self.backend, "timeout_s": self.spec.join_timeout_s},
            ),
        )
        try:
            self.group = join_weight_update_group(
                self.spec.master_address,
                port,
                0,
                self.world_size,
                GROUP_NAME,
                self.backend,
                timedelta(seconds=self.spec.join_timeout_s),
            )
            joins.result(timeout=self.spec.join_timeout_s + 30)
        except Exception as exc:
            ranks = {t.engine_id: list(range(t.rank_offset, t.rank_offset + t.num_ranks)) for t in self.targets}
            raise RuntimeError(
                f"weight update group {GROUP_NAME!r} at {where} did not form within {self.spec.join_timeout_s:.0f} s "
                f"(world_size={self.world_size}; sender rank 0; engine ranks {ranks}): {exc}; check that every "
                "engine can reach the address and that nothing else uses the port"
            ) from exc
        # Engines that run numbered calls in order (rollfleet.engine.weights.call_order) take the next
        # calls' announcements while a call is on the wire; others (SGLang) get one call at a time.
        ordered = all(info.get("rollfleet_ordered_weight_calls") for info in infos)
        self.calls_ahead = CALLS_AHEAD if ordered else 1

    def send(self, source: WeightSource, version: str) -> SyncReport:
        if self.group is None:
            raise RuntimeError("NcclTransport.send before connect(): connect() forms the weight-update group")
        report, collectors = self._new_report(version), self._collectors()
        with timed(report), prompt_handoffs():
            self._begin()
            try:
                self._send_calls(source, version, report, collectors)
            except BaseException:
                self.broken = True  # a broadcast may still wait for a dead or hung engine
                self._abandon()
                raise
            committing = self._commit(version)
            self._finish_fingerprints(report, collectors)
            with timed(report, "set_version"):
                error = wait_all(*committing)
        if error is not None:
            raise error
        return report

    def _send_calls(self, source: WeightSource, version: str, report: SyncReport, collectors: dict) -> None:
        broadcasts: list = [None, None]  # the broadcast that last used each buffer
        answers: deque = deque()  # the engines' answers to announced calls, oldest first
        sync_id = f"{version}:{secrets.token_hex(4)}"
        try:
            for index, call in enumerate(
                iter_calls(self._recorded(source.named_tensors(), report, collectors), self.spec.bucket_bytes)
            ):
                call = aligned_order(call)  # SGLang's receive bucket refuses unaligned tensors
                slot = index % 2
                with timed(report, "pack"):
                    if broadcasts[slot] is not None:  # reuse the buffer once its broadcast has left it
                        broadcasts[slot].wait()
                        broadcasts[slot] = None
                    flat = pack_bytes(call, self.buffers.take(slot, call_bytes(call), self.device))
                with timed(report, "wait_engines"):
                    while len(answers) >= self.calls_ahead:
                        answers.popleft().result()
                answers.append(self._announce(call, (sync_id, index) if self.calls_ahead > 1 else None, version))
                # one broadcast of every tensor's bytes back to back (mixed dtypes are allowed);
                # it runs while the next call is packed and announced
                broadcasts[slot] = dist.broadcast(flat, group=self.group, group_src=0, async_op=True)
                report.buckets += 1
            with timed(report, "wait_engines"):
                while answers:
                    answers.popleft().result()
        finally:
            # every started announcement and broadcast completes, so the group is not left with a
            # half-done transfer; after an error, theirs are its consequences
            wait_all(*answers, *broadcasts)

    def _announce(self, call, order: tuple[str, int] | None, version: str):
        """/update_weights_from_distributed for one call: its tensors' names, dtypes and shapes, in order."""
        names = [name for name, _ in call]
        dtypes = [dtype_name(tensor.dtype) for _, tensor in call]
        shapes = [list(tensor.shape) for _, tensor in call]
        options = {"group_name": GROUP_NAME, "load_format": "flattened_bucket", "flush_cache": False, "order": order}
        return self._each(
            "update_weights_from_distributed",
            lambda t: ((names, dtypes, shapes), {**options, **self._version_argument(t, version)}),
        )

    def disconnect(self) -> None:
        if self.group is not None:
            # NCCL's destroy waits for every member: the engines and the sender leave together
            leaving = self._each("destroy_weights_update_group", lambda t: ((GROUP_NAME,), {}))
            if self.broken:
                _abort(self.group)  # a dead engine never leaves: a destroy (or the watchdog) would wait for it
                wait_all(leaving)  # the live ones leave; the dead ones' errors are the failure already raised
            else:
                dist.destroy_process_group(self.group)
                leaving.result()
            self.group, self.broken = None, False
        self.buffers = DoubleBuffer(self.spec.bucket_bytes)  # drop the staging buffers
        super().disconnect()


def _abort(group) -> None:
    """End a group whose last transfer failed without waiting for its members: NCCL's abort stops the
    sender's kernels still waiting on a dead or stopped engine (the CUDA stream is usable after it);
    gloo's transfers already failed on the closed connection, so a destroy returns."""
    if dist.get_backend(group) == "nccl":
        _abort_process_group(group)
    else:
        dist.destroy_process_group(group)
