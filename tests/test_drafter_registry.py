"""The drafter registry: a family defined here, outside the library, registers with one line and then builds,
initialises, drafts, counts its parameters, gets its loss recipe and saves its config through the same entry
points as the built-in families (and is told plainly that the speculators format cannot express it)."""

import dataclasses
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.checkpoints.drafter_io import config_from_dict, config_to_dict
from hspec_jax.checkpoints.hf import CheckpointError
from hspec_jax.checkpoints.speculators import speculators_config
from hspec_jax.drafters import (
    DRAFTER_KINDS,
    DrafterConfig,
    DrafterFamily,
    DrafterKind,
    DraftInputs,
    DraftOutput,
    draft_blocks,
    drafter_config,
    drafter_param_shapes,
    init_drafter,
    init_from_target,
    register_family,
    register_kind,
)
from hspec_jax.drafters.family import DRAFTER_FAMILIES, compared_kinds
from hspec_jax.drafters.output import draft_logits
from hspec_jax.drafters.params import count_by_component, trainable_mask
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import init_params
from hspec_jax.models.layers import dense
from hspec_jax.recipes import target_config
from train.losses import LossWeights, recipe_weights

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)


@dataclasses.dataclass(frozen=True)
class ToyConfig(DrafterConfig):
    kind = "toy"
    width: int = 16

    def __post_init__(self):
        self._check_common()


class Toy(nn.Module):
    """One dense layer over the block embeddings, then the shared final norm and draft lm_head."""

    config: ToyConfig

    @nn.compact
    def __call__(self, embeds, inputs: DraftInputs) -> DraftOutput:
        cfg = self.config
        h = dense(cfg.target.hidden_size, "proj", dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)(embeds)
        hidden, logits = draft_logits(self, cfg, h)
        return DraftOutput(hidden, logits, None)


TOY = DrafterFamily("toy", ToyConfig, Toy, components={"proj": "block projection"})


@pytest.fixture(scope="module")
def toy():
    register_kind(DrafterKind("toy", register_family(TOY), loss={"tv": 0.0}))
    yield
    del DRAFTER_KINDS["toy"], DRAFTER_FAMILIES["toy"]


def recipe_fields() -> dict:
    fields = RECIPE.drafter.to_dict()
    fields.pop("kind")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def test_a_family_registered_outside_the_library_works_end_to_end(toy):
    config = drafter_config("toy", TARGET, **recipe_fields(), width=8)
    assert type(config) is ToyConfig and config.kind == "toy" and config.width == 8
    assert not config.owns_kv_cache and "toy" not in compared_kinds()

    params = init_drafter(config, jax.random.key(0))
    assert set(params) == {"proj", "norm", "lm_head"}
    vocab = build_draft_vocab(np.arange(TARGET.vocab_size), TARGET.vocab_size, config.vocab_size)
    params = init_from_target(params, config, init_params(TARGET, jax.random.key(1)), vocab)

    tokens = jax.random.randint(jax.random.key(2), (2, 3, config.block_size), 0, TARGET.vocab_size)
    embedding = jax.random.normal(jax.random.key(3), (TARGET.vocab_size, TARGET.hidden_size))
    inputs = DraftInputs(embedding=embedding, block_tokens=tokens, anchors=jnp.zeros((2, 3), jnp.int32))
    out = draft_blocks(params, config, inputs)
    assert out.logits.shape == (2, 3, config.block_size, config.vocab_size)
    assert np.isfinite(np.asarray(out.logits)).all()

    counts = count_by_component(drafter_param_shapes(config), config)
    d = TARGET.hidden_size
    assert counts["block projection"] == {"trainable": d * d, "frozen": 0}
    assert counts["draft lm_head"] == {"trainable": 0, "frozen": config.vocab_size * d}
    assert jax.tree.leaves(trainable_mask(params, config)).count(False) == 1  # the lm_head

    assert recipe_weights("toy") == LossWeights(0.1, 0.0, 1.0, 4.0)
    assert config_from_dict(config_to_dict(config), TARGET) == config
    with pytest.raises(CheckpointError, match="'toy' drafter family has no speculators format"):
        speculators_config(config, None)


def test_a_parameter_without_a_component_is_an_error_naming_it(toy):
    config = drafter_config("toy", TARGET, **recipe_fields())
    shapes = drafter_param_shapes(config)
    shapes["extra"] = shapes["norm"]
    with pytest.raises(KeyError, match="'extra' of the 'toy' drafter family"):
        count_by_component(shapes, config)


def test_an_unknown_kind_lists_the_registered_kinds():
    with pytest.raises(ValueError, match="unknown drafter kind 'eagle'; choose from") as info:
        drafter_config("eagle", TARGET, **recipe_fields())
    assert all(name in str(info.value) for name in DRAFTER_KINDS)
    with pytest.raises(ValueError, match="unknown drafter kind 'eagle'"):
        recipe_weights("eagle")


def test_registering_a_taken_name_is_an_error(toy):
    with pytest.raises(ValueError, match="'hspec' is already registered"):
        register_kind(DrafterKind("hspec", TOY))
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register_family(TOY)
