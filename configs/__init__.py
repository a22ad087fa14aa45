"""Recipe files (`ml_collections` `get_config()`), one per target; load them with `hspec_jax.recipes.load_config`."""
