"""SGLang's own weight-update receiving path behind its HTTP routes, on CPU, with a recording model:
the SGLang side of tests/test_sglang_contract.py. Run as `python tests/sglang_harness.py` with the
sglang wheel on PYTHONPATH (`make sglang-site`); it prints `LISTENING <port>` and serves until killed.

What runs is SGLang's code: its request structs parse the JSON bodies exactly as its http_server
does (FastAPI with the structs as bodies), `normalize_serialized_named_tensor_payloads` as its
tokenizer manager does, its `SchedulerWeightUpdaterManager` (session checks, versions), its tp
worker's `deserialize_own_rank` and `load_lora_adapter_from_tensors`, its model runner's
`WeightUpdater` (flattened buckets, the gloo/nccl update group and bucketed receive) and its
safetensors iterator for disk updates, and its release and resume of memory by tag (the memory
saver recorded). What is not SGLang's: the model (it records what
`load_weights` gets), the runtime context its launcher would publish (tp rank 0 of 1, the gloo
world group), and the scheduler's version bookkeeping (recorded). `/contract/*` routes read the
records, and `/contract/feed` sends SGLang's own client payloads to another engine.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sys
from types import SimpleNamespace
from typing import Annotated

sys.path.insert(0, os.path.dirname(__file__))
import sglang_stubs  # noqa: E402,F401  (before any sglang module)

# isort: split
import httpx  # noqa: E402
import sglang  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing.reductions  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import Body, FastAPI  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList  # noqa: E402
from sglang.srt.layers.utils import get_layer_id  # noqa: E402
from sglang.srt.lora.lora import LoRAAdapter  # noqa: E402
from sglang.srt.lora.lora_config import LoRAConfig  # noqa: E402
from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry  # noqa: E402
from sglang.srt.managers import io_struct as req  # noqa: E402
from sglang.srt.managers import tp_worker as tp_worker_module  # noqa: E402
from sglang.srt.managers.scheduler_components import weight_updater as scheduler_side  # noqa: E402
from sglang.srt.model_executor.model_runner_components import weight_updater as runner_side  # noqa: E402
from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator  # noqa: E402
from sglang.srt.utils import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads  # noqa: E402
from sglang.srt.utils.msgspec_utils import msgspec_to_builtins  # noqa: E402
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: E402

from rollfleet.wire.buckets import DTYPES  # noqa: E402
from rollfleet.wire.fingerprint import fingerprints  # noqa: E402
from rollfleet.wire.net import free_port  # noqa: E402


def describe(tensor: torch.Tensor) -> list:
    """[dtype, shape, sha256 of the bytes]: equal iff bit-exact."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), hashlib.sha256(data).hexdigest()]


class RecordingModel(torch.nn.Module):
    """Stands for SGLang's model: keeps what `load_weights` receives."""

    def __init__(self):
        super().__init__()
        self.loaded: dict[str, list] = {}

    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.loaded[name] = describe(tensor)


model = RecordingModel()
versions: list[str | None] = []
adapters: dict[str, dict] = {}
unloaded: list[str] = []
registry = LoRARegistry()  # SGLang's tokenizer-manager registry of loaded adapters (what /v1/models lists)
SERVED_MODEL_NAME = "recording"
context = SimpleNamespace(tp_rank=0, tp_size=1, dp_size=1, tp_group=None)  # what SGLang's launcher publishes
for module in (scheduler_side, runner_side, tp_worker_module):
    module.get_parallel = lambda: context
runner_side.get_model = lambda: SimpleNamespace(weight_cache_mode="off")
scheduler_side.get_model = runner_side.get_model  # read by its release/resume of weights (0.5.23)


def record_lora(ref, tensors, config_dict, added_tokens_config):
    adapters[ref.lora_name] = {
        "tensors": {k: describe(v) for k, v in tensors.items()},
        "config": config_dict,
        "parsed": sglang_parse(tensors, config_dict, added_tokens_config),
    }
    return req.LoRAUpdateOutput(success=True, loaded_adapters={name: "__tensor__" for name in adapters})


def sglang_parse(tensors, config_dict, added_tokens_config) -> dict:
    """What SGLang's LoRAAdapter makes of the tensors (its lora manager's load from tensors, on a model
    of as many layers as the keys name): the embedding layers it keeps (embed_tokens, lm_head) and the
    names of each layer's weights after its normalisation (q, k, v stacked into qkv_proj)."""
    layers = 1 + max((i for i in map(get_layer_id, tensors) if i is not None), default=0)
    base = SimpleNamespace(num_hidden_layers=layers, vocab_size=None)
    adapter = LoRAAdapter("recorded", LoRAConfig.from_dict(config_dict, added_tokens_config), base, None, None)
    try:
        adapter.initialize_weights_from_tensors(tensors)
    except KeyError as exc:  # 0.5.23's normalize_qkv_proj needs v_proj beside q_proj: a q_proj-only adapter fails
        return {"error": f"KeyError: {exc}"}
    return {
        "embedding_layers": {k: describe(v) for k, v in adapter.embedding_layers.items()},
        "layer_weights": [sorted(layer.weights) for layer in adapter.layers],
    }


class MemorySaver:
    """Stands for SGLang's torch_memory_saver adapter: records what is paused and resumed, by tag."""

    def __init__(self):
        self.events: list[list[str]] = []

    def pause(self, tag: str) -> None:
        self.events.append(["pause", tag])

    def resume(self, tag: str) -> None:
        self.events.append(["resume", tag])


memory_saver = MemorySaver()


class TpWorker:
    """SGLang's tp worker methods on a model runner that holds SGLang's WeightUpdater."""

    deserialize_own_rank = tp_worker_module.BaseTpWorker.deserialize_own_rank
    load_lora_adapter_from_tensors = tp_worker_module.BaseTpWorker.load_lora_adapter_from_tensors
    init_weights_update_group = tp_worker_module.BaseTpWorker.init_weights_update_group
    destroy_weights_update_group = tp_worker_module.BaseTpWorker.destroy_weights_update_group

    def __init__(self):
        updater = runner_side.WeightUpdater(
            tp_rank=0,
            device="cpu",
            gpu_id=0,
            model_config=SimpleNamespace(dtype=torch.float32),
            custom_weight_loaders={},
            get_model=lambda: model,
            update_model_fields=lambda *args, **kwargs: None,
            recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: None,
        )
        # tp_rank: where SGLang 0.5.21 reads a worker's rank (later releases: the runtime context)
        self.model_runner = SimpleNamespace(
            weight_updater=updater, load_lora_adapter_from_tensors=record_lora, tp_rank=0, tp_size=1, model=model
        )

    def weight_update_runners(self):
        return [("target", self.model_runner)]


app = FastAPI()


def answer(out) -> JSONResponse:
    body = msgspec_to_builtins(out)
    return JSONResponse(body, status_code=200 if body.get("success", True) else 400)


@app.get("/get_server_info")
def get_server_info():
    return {"version": sglang.__version__}


@app.get("/get_model_info")
def get_model_info():
    return {"model_path": "recording", "weight_version": versions[-1] if versions else None}


@app.post("/begin_weight_update")
def begin(obj: Annotated[req.BeginWeightUpdateReqInput, Body()]):
    return answer(manager.begin_weight_update(obj))


@app.post("/end_weight_update")
def end(obj: Annotated[req.EndWeightUpdateReqInput, Body()]):
    return answer(manager.end_weight_update(obj))


@app.post("/update_weights_from_tensor")
def from_tensor(obj: Annotated[req.UpdateWeightsFromTensorReqInput, Body()]):
    obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
    return answer(manager.update_weights_from_tensor(obj))


@app.post("/init_weights_update_group")
def init_group(obj: Annotated[req.InitWeightsUpdateGroupReqInput, Body()]):
    return answer(manager.init_weights_update_group(obj))


@app.post("/update_weights_from_distributed")
def from_distributed(obj: Annotated[req.UpdateWeightsFromDistributedReqInput, Body()]):
    return answer(manager.update_weights_from_distributed(obj))


@app.post("/destroy_weights_update_group")
def destroy_group(obj: Annotated[req.DestroyWeightsUpdateGroupReqInput, Body()]):
    return answer(manager.destroy_weights_update_group(obj))


@app.post("/update_weight_version")
def update_weight_version(obj: Annotated[req.UpdateWeightVersionReqInput, Body()]):
    versions.append(obj.new_version)
    return {"success": True, "message": "ok", "new_version": obj.new_version}


@app.post("/update_weights_from_disk")
def from_disk(obj: Annotated[req.UpdateWeightFromDiskReqInput, Body()]):
    files = sorted(glob.glob(os.path.join(obj.model_path, "*.safetensors")))
    model.load_weights(safetensors_weights_iterator(files))
    versions.append(obj.weight_version)
    return {"success": bool(files), "message": f"{len(files)} files", "num_paused_requests": 0}


@app.post("/load_lora_adapter_from_tensors")
async def lora_from_tensors(obj: Annotated[req.LoadLoRAAdapterFromTensorsReqInput, Body()]):
    """As SGLang's tokenizer manager does it: a LoRARef at path "__tensor__" names the adapter, the tp
    worker loads it, and a success registers it (SGLang's registry refuses a name already loaded)."""
    obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
    ref = LoRARef(lora_name=obj.lora_name, lora_path="__tensor__", pinned=obj.pinned)
    obj.lora_id = ref.lora_id
    out = TpWorker.load_lora_adapter_from_tensors(worker, obj)
    if out.success:
        await registry.register(ref)
    return answer(out)


@app.post("/unload_lora_adapter")
async def unload_lora(obj: Annotated[req.UnloadLoRAAdapterReqInput, Body()]):
    await registry.unregister(obj.lora_name)  # SGLang's: a name not loaded is an error
    unloaded.append(obj.lora_name)
    adapters.pop(obj.lora_name, None)
    return answer(req.LoRAUpdateOutput(success=True, loaded_adapters={name: "__tensor__" for name in adapters}))


@app.post("/release_memory_occupation")
def release_memory(obj: Annotated[req.ReleaseMemoryOccupationReqInput, Body()]):
    manager.release_memory_occupation(obj)
    return None  # SGLang's http_server answers both with an empty body


@app.post("/resume_memory_occupation")
def resume_memory(obj: Annotated[req.ResumeMemoryOccupationReqInput, Body()]):
    manager.resume_memory_occupation(obj)  # SGLang's own bookkeeping: a tag not released raises KeyError
    return None


@app.get("/contract/memory")
def memory_record():
    held = getattr(manager, "offload_tags", None)  # SGLang's own record of released tags (0.5.23)
    return {"events": memory_saver.events, "released": None if held is None else sorted(held)}


@app.get("/v1/models")
def available_models():
    """SGLang's /v1/models with LoRA enabled (its http_server's available_models, over its own
    registry and cards): the served model, then one card per adapter with the model as `parent`."""
    cards = [ModelCard(id=SERVED_MODEL_NAME, root=SERVED_MODEL_NAME, max_model_len=None)]
    for ref in registry.get_all_adapters().values():
        cards.append(ModelCard(id=ref.lora_name, root=ref.lora_path, parent=SERVED_MODEL_NAME, max_model_len=None))
    return ModelList(data=cards).model_dump()


@app.get("/contract/recorded")
def recorded():
    return {"weights": model.loaded, "versions": versions, "adapters": adapters, "unloaded": unloaded}


@app.post("/contract/reset")
def reset():
    model.loaded.clear(), versions.clear(), adapters.clear(), unloaded.clear()
    return {}


@app.post("/contract/feed")
def feed(spec: dict):
    """SGLang's client side: `spec["tensors"]` ([name, shape, dtype]) made from `spec["seed"]`, sent
    to the engine at `spec["url"]` as SGLang's clients send them (FlattenedTensorBucket +
    MultiprocessingSerializer, its request structs as JSON, inside a weight-update session), in
    `spec["load_format"]` ("flattened_bucket" or "direct"). Answers rollfleet's fingerprints of what was sent."""
    # SGLang's receive path patched torch's reductions for CUDA tensors in this process
    # (monkey_patch_torch_reductions); the patched reducer cannot pickle CPU tensors, so a CPU client
    # pickles with torch's own (the patched CUDA form is the engine allowlist's concern)
    reductions = torch.multiprocessing.reductions
    reductions.reduce_tensor = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    reductions.init_reductions()
    generator = torch.Generator().manual_seed(spec["seed"])
    named = [(n, torch.randn(shape, generator=generator).to(DTYPES[dtype])) for n, shape, dtype in spec["tensors"]]
    if spec["load_format"] == "flattened_bucket":
        bucket = FlattenedTensorBucket(named_tensors=named)
        payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    else:
        payload = named
    update = req.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(payload, output_str=True)],
        load_format=spec["load_format"],
        flush_cache=False,
        weight_version=spec["version"],
    )
    body = {k: v for k, v in msgspec_to_builtins(update).items() if k not in ("rid", "http_worker_ipc")}
    steps = [
        ("/begin_weight_update", msgspec_to_builtins(req.BeginWeightUpdateReqInput())),
        ("/update_weights_from_tensor", body),
        ("/end_weight_update", {}),
    ]
    with httpx.Client(base_url=spec["url"], timeout=120) as client:
        for route, step_body in steps:
            response = client.post(route, json=step_body)
            if response.status_code != 200:
                return JSONResponse({"route": route, "answer": response.text}, status_code=400)
    return {"fingerprints": fingerprints(named, samples=1 << 20)}


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    context.tp_group = SimpleNamespace(cpu_group=dist.group.WORLD)
    worker = TpWorker()
    # SGLang 0.5.21 takes the tp cpu group as an argument; later releases read it from the runtime context
    takes_group = any(
        f.name == "tp_cpu_group" and f.init for f in dataclasses.fields(scheduler_side.SchedulerWeightUpdaterManager)
    )
    manager = scheduler_side.SchedulerWeightUpdaterManager(
        **({"tp_cpu_group": context.tp_group.cpu_group} if takes_group else {}),
        tp_worker=worker,
        draft_worker=None,
        memory_saver_adapter=memory_saver,
        flush_cache=lambda **kwargs: True,
        is_fully_idle=lambda **kwargs: True,
        scheduler=SimpleNamespace(
            record_weight_version_change=lambda new_version: versions.append(new_version),
            _engine_paused=False,
            disaggregation_mode=DisaggregationMode.NULL,
        ),
    )
    port = free_port()
    print(f"LISTENING {port} sglang={sglang.__version__}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
