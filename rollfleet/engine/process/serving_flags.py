"""Server flags of SGLang's serving surface (OpenAI routes, auth, memory saver), kept apart from the
engine's core flags in server_args.py."""

from __future__ import annotations

import argparse

from rollfleet.wire.auth import OPEN_PATHS
from rollfleet.wire.routed_experts import ROUTED_EXPERTS_FLAG


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in the OpenAI routes (default: --model-path)"
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file for /v1/chat/completions (default: the tokenizer's own)",
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep a host copy of released weights and restore it on resume, so the engine serves "
        "again without a push (SGLang's flag); without it released weights must be pushed again",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (see --admin-api-key)")
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="SGLang's admin key: with it the admin routes (weight updates and their groups and sessions, "
        "memory release/resume, pause/continue/abort, flush, LoRA loads, R-Fork sends, every /rollfleet/ "
        "route) take only 'Authorization: Bearer ADMIN_KEY', never the --api-key; the other routes "
        "(generate, OpenAI, status) take the --api-key, and are open without one",
    )
    p.add_argument(
        "--api-key-open-paths",
        nargs="*",
        default=list(OPEN_PATHS),
        help="path prefixes answered without a key, as SGLang does (default: /health /ready /metrics, "
        "which covers /health_generate); give none to require the key everywhere",
    )
    p.add_argument(
        ROUTED_EXPERTS_FLAG,
        action="store_true",
        help="answer return_routed_experts: true in /generate with meta_info.routed_experts (MoE models; "
        "SGLang's flag): the experts each layer chose per token, for routing replay in the trainer",
    )
    p.add_argument(
        "--rollfleet-partial-weight-updates",
        action="store_true",
        help="commit a weight-update session that did not send every tensor, as SGLang does (the tensors "
        "not sent keep their values); by default such a session is refused and the engine serves nothing "
        "until a complete one, so a push that lost a tensor is never served",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="share of the GPU's memory this engine may hold (SGLang's flag; here a cap on torch's allocator, "
        "so that two engines can split one GPU); nothing to cap on CPU",
    )
