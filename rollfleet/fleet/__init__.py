"""The rollout fleet on Ray: workers per GPU, engine launch, routing."""
