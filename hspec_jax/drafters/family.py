"""The drafter families and kinds: one registry that every caller reads instead of branching on names.

A *family* is one architecture (`DrafterFamily`): its config class, its Linen module and what the rest of the
project needs to know about it. A *kind* is a named recipe of a family (`DrafterKind`): "dspark" is the DFlash
family with a Markov head drafting from the anchor. Each family module (`hspec.py`, `dflash.py`) registers
itself and its kinds; a new family is one module that does the same, and then builds, initialises, drafts,
counts its parameters, trains and saves through the same entry points:

    FAMILY = register_family(DrafterFamily("toy", ToyConfig, Toy, components={"proj": "projection"}))
    register_kind(DrafterKind("toy", FAMILY))

`DRAFTER_KINDS` maps kind names to kinds, in registration order; `drafter_kind(name)` looks one up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def _no_mirrored_layers(config) -> dict[str, int]:
    return {}


def _recipe_fields(fields: dict, target) -> dict:
    return fields


@dataclasses.dataclass(frozen=True, eq=False)
class DrafterFamily:
    """What one drafter architecture is.

    * `name`: saved in drafter checkpoints (`checkpoints.drafter_io`);
    * `config`: its frozen config class (a `DrafterConfig` subclass naming its `kind`);
    * `module`: `module(config)` is a Linen module, `module(config).apply({"params": p}, embeds [B, A, T, D],
      inputs: DraftInputs) -> DraftOutput [B, A, T, ...]` (`draft_blocks`);
    * `components`: its own top-level parameter names -> component (for `drafters.params`), beyond the ones
      every drafter has (norm, lm_head, mask embedding, Markov / confidence heads);
    * `nested`: config fields holding a nested frozen dataclass -> that class (saved as a dict);
    * `mirrored_layers(config)`: drafter attention layer name -> the target layer whose KV it reads and whose
      q/k/v it copies (`init_from_target`);
    * `inject(params, config, drafter_cache, inject_rows) -> drafter_cache`: write context rows into the drafter's own
      cache without drafting, for a family whose `config.cache_layers` can be > 0 (None: it keeps no cache).
    """

    name: str
    config: type
    module: Callable[[Any], Any]
    components: Mapping[str, str] = dataclasses.field(default_factory=dict)
    nested: Mapping[str, type] = dataclasses.field(default_factory=dict)
    mirrored_layers: Callable[[Any], dict[str, int]] = _no_mirrored_layers
    inject: Callable | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class DrafterKind:
    """A named recipe of a family. `fields(recipe_fields, target) -> fields` applies the kind's overrides to a
    recipe's fields (already filtered to the family's own); `loss`: the loss weights (`ce`, `tv`, `confidence`)
    where the kind's training recipe differs from the default 0.1 CE + 0.9 TV + 1.0 confidence; `compared`: one
    of the drafters the comparison tables and benchmarks put side by side."""

    name: str
    family: DrafterFamily
    fields: Callable[[dict, Any], dict] = _recipe_fields
    loss: Mapping[str, float] = dataclasses.field(default_factory=dict)
    compared: bool = False


DRAFTER_FAMILIES: dict[str, DrafterFamily] = {}
DRAFTER_KINDS: dict[str, DrafterKind] = {}


def register_family(family: DrafterFamily) -> DrafterFamily:
    """Add `family` to the registry (its name and config class must be new) and return it."""
    if family.name in DRAFTER_FAMILIES:
        raise ValueError(f"drafter family {family.name!r} is already registered")
    if any(f.config is family.config for f in DRAFTER_FAMILIES.values()):
        raise ValueError(f"config class {family.config.__name__} already belongs to a drafter family")
    DRAFTER_FAMILIES[family.name] = family
    return family


def register_kind(kind: DrafterKind) -> DrafterKind:
    """Add `kind` to the registry (its name must be new, its family registered) and return it."""
    if kind.name in DRAFTER_KINDS:
        raise ValueError(f"drafter kind {kind.name!r} is already registered")
    if DRAFTER_FAMILIES.get(kind.family.name) is not kind.family:
        raise ValueError(f"drafter kind {kind.name!r}: register its family {kind.family.name!r} first")
    DRAFTER_KINDS[kind.name] = kind
    return kind


def drafter_kind(name: str) -> DrafterKind:
    """The registered kind `name`; an unknown name is an error listing the registered ones."""
    if name not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; choose from {', '.join(DRAFTER_KINDS)}")
    return DRAFTER_KINDS[name]


def drafter_family(name: str) -> DrafterFamily:
    """The registered family `name`; an unknown name is an error listing the registered ones."""
    if name not in DRAFTER_FAMILIES:
        raise ValueError(f"unknown drafter family {name!r}; choose from {', '.join(DRAFTER_FAMILIES)}")
    return DRAFTER_FAMILIES[name]


def family_of(config) -> DrafterFamily:
    """The family whose config class `config` is."""
    for family in DRAFTER_FAMILIES.values():
        if type(config) is family.config:
            return family
    raise TypeError(f"not a registered drafter config: {type(config).__name__}")


def compared_kinds() -> tuple[str, ...]:
    """The kinds the comparison tables and benchmarks put side by side, in registration order."""
    return tuple(name for name, kind in DRAFTER_KINDS.items() if kind.compared)
