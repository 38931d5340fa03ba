"""The model inside one tp rank: the runner (model: loading, prefill and decode, weight reads, memory
release and resume, the lockstep actions' methods) and the routers' chosen experts (route_capture)."""
