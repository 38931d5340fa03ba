"""The embedded rollout engine: an HTTP server that speaks SGLang's protocol, and its client."""
