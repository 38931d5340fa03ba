"""The engine's processes, its top layer: the server a process runs (server: `python -m
rollfleet.engine.process.server`, the process tree), its flags (server_args, serving_flags) and rank 0's
serving side (rank_zero), starting and stopping one from a launcher (launch), the pre-imported
launcher and its client (zygote, zygote_client), and where a start's time goes (start_timing)."""
