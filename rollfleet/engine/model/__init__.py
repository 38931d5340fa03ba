"""The model inside one tp rank: building it (build: its class, device, TP/EP layout, a dummy build),
the runner (model: prefill and decode, weight reads, memory release and resume, the lockstep actions'
methods) and the routers' chosen experts (route_capture)."""
