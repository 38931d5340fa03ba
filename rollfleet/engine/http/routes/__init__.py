"""HTTP routes of the embedded engine, by job: generate, weights, lora, control. Module-level
handlers over one `EngineService` (service.py)."""
