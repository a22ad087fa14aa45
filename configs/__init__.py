"""Recipe files (`ml_collections`), one per target: `python -m train.main --config=configs/llama.py`."""
