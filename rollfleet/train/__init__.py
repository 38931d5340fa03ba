"""The trainer side: GRPO math (grpo.py) and the FSDP2 policy trainer (fsdp.py)."""
