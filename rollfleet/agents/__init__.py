"""Multi-turn episodes over the fleet: environments with tools, exact tokens across turns."""
