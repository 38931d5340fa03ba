"""What engine and weights both speak: SGLang request models, the engine client, buckets,
serialization, fingerprints, naming, the weight-update group, HF files on disk."""
