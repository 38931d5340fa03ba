"""The trainer side: GRPO math (grpo.py) and the FSDP2 policy trainer (fsdp.py; its model built and
sharded by sharding.py, its files written by trainer_files.py)."""
