"""How the engine's weights change, above LoRA and the scheduler and below the model: updates on one
rank (weight_update), update groups (weight_groups), storages for release and resume
(weight_storage), fingerprints of an update (load_prints), R-Fork on one rank and its flags
(remote_instance, remote_args), numbered calls in order (call_order), and update sessions over the
scheduler (weight_session)."""
