#!/usr/bin/env bash
# GPU check of the GRPO loop (issue: the main job): a few steps colocated (trainer world 2, two tp=1
# engines, CUDA IPC) and disaggregated (trainer on one GPU, one engine on the other, NCCL).
# Writes each run's metrics.jsonl under $OUT (or ./runs).
set -u
out=${OUT:-runs}
python3 -c "from rollfleet.tiny_models import make_tiny_model as m; m('/tmp/gpu-small', hidden_size=512, num_hidden_layers=4, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=64)" >/dev/null 2>&1
common="rollout.model_path=/tmp/gpu-small rollout.use_gpu=true grpo.steps=4 grpo.prompts_per_step=16 rollout.sampling.n=8 rollout.sampling.max_new_tokens=16"
timeout 140 python3 -m rollfleet train examples/cpu-demo.yaml $common rollout.num_engines=2 \
  rollout.placement=colocated rollout.gpus_per_worker=0.5 trainer.world_size=2 weight_sync.transport=tensor \
  grpo.output_dir=/tmp/run-colocated ray.num_cpus=16 > $out/colocated.log 2>&1; echo "colocated rc=$?"
cp /tmp/run-colocated/metrics.jsonl $out/colocated-metrics.jsonl 2>/dev/null
timeout 120 python3 -m rollfleet train examples/cpu-demo.yaml $common rollout.num_engines=1 \
  rollout.placement=disaggregated trainer.world_size=1 weight_sync.transport=nccl \
  grpo.output_dir=/tmp/run-disaggregated ray.num_cpus=16 > $out/disaggregated.log 2>&1; echo "disaggregated rc=$?"
cp /tmp/run-disaggregated/metrics.jsonl $out/disaggregated-metrics.jsonl 2>/dev/null
grep -h "step " $out/colocated.log $out/disaggregated.log
