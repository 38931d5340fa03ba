"""Rank 0's engine thread over the KV cache: the scheduler's queues and batches (scheduler,
batch_step), what a request must satisfy to be queued (admission), aborting, pausing and stepping
(mixins of the Scheduler), and which memory tags are released (memory_tags)."""
