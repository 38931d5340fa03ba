"""Prompt datasets (prompts.py) and the bundled synthetic task (synthetic.py)."""
