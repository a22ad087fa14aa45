"""The training loop behind `train.main`: set-up, resume, steps, logs, checkpoints, periodic real tau, export.

`train(config, workdir)` is the whole job (see `train/main.py` for the command line and the work directory's
layout); the pieces below are small so a researcher can reuse them in their own loop.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import time

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from hspec_jax import parallel
from hspec_jax.chat import chat_prompt_ids
from hspec_jax.checkpoints.drafter_io import (
    TRAINING_RECORD,
    save_drafter,
    target_lm_head,
)
from hspec_jax.cli import portable
from hspec_jax.decoding import pad_batch
from hspec_jax.decoding.bundle import Bundle
from hspec_jax.decoding.speculative import speculative_generate
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.drafters.vocab import DraftVocab, draft_vocab_from_counts, vocab_from_ids
from hspec_jax.errors import InputError, causes
from hspec_jax.recipes import drafter_from_recipe
from train.chat import user_texts
from train.checks import check_recipe, record_recipe
from train.data import Source, exclude_held_out, load_conversations, load_mixture, source_fingerprint
from train.losses import loss_from_sums, recipe_weights
from train.optim import make_optimizer
from train.pipeline import BATCH_KEYS, make_train_iterator, sampled_token_counts
from train.step import StepConfig, TrainState, eval_sums_fn, fresh_state, make_train_step
from train.targets import load_target_and_tokenizer
from train.tensorboard import EventWriter
from train.warm_start import cut_vocab, parse_layers, starting_drafter, starting_params

log = logging.getLogger(__name__)
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Run:
    """What the loop needs, built once by `setup`."""

    config: ml_collections.ConfigDict
    workdir: str
    target: object
    target_params: dict  # placed on the mesh as in inference
    tokenizer: object
    drafter: DrafterConfig
    vocab: DraftVocab
    mesh: jax.sharding.Mesh
    iterator: object
    held_out: list  # token ids of the held-out prompts (real tau)
    held_out_batches: list  # fixed global batches of the held-out conversations (training-path metrics)
    data_report: dict
    held_out_families: dict = dataclasses.field(default_factory=dict)  # family -> its fixed global batches


def draft_vocabulary(
    workdir: str, loaded, tokenizer, target, drafter: DrafterConfig, data: ml_collections.ConfigDict, given=None
):
    """(draft vocabulary, supervised token counts `[V]`): read from the work directory on resume, else `given`
    (a fine-tuning run keeps its starting drafter's, or its most frequent tokens for a smaller drafter cut from it:
    `train/warm_start.py`) or built from the supervised tokens of a random sample of
    the training data (`data.vocab_sample_tokens` of them, drawn with `data.seed`; top `draft_vocab_size` by
    frequency, EOS always kept), and written there by process 0 (every process computes the same). Every process
    looks for the file before process 0 may write it, so all of them take the same branch (and meet at the same
    barriers) however far apart they start."""
    path = os.path.join(workdir, "vocab.npz")
    resuming = os.path.exists(path)
    multihost_utils.sync_global_devices("draft vocabulary looked up")
    if resuming:
        with np.load(path) as stored:
            if stored["d2t"].shape[0] != drafter.vocab_size:
                raise InputError(
                    f"{path} holds a draft vocabulary of {stored['d2t'].shape[0]} tokens but the recipe asks for "
                    f"{drafter.vocab_size}: use a new --workdir"
                )
            return vocab_from_ids(stored["d2t"], target.vocab_size), stored["supervised_counts"]
    log.info("counting the supervised tokens of a sample of the conversations for the draft vocabulary")
    counts, read = sampled_token_counts(loaded, tokenizer, target.vocab_size, data.vocab_sample_tokens, data.seed)
    log.info("draft vocabulary: %d supervised tokens of %d conversations", counts.sum(), read)
    if given is None:
        vocab = draft_vocab_from_counts(counts, drafter.vocab_size, always=target.eos_token_ids)
    else:
        vocab = cut_vocab(given, drafter.vocab_size, counts, target.eos_token_ids)
    if jax.process_index() == 0:
        partial = path + ".partial.npz"
        np.savez(partial, d2t=np.asarray(vocab.d2t), t2d=np.asarray(vocab.t2d), supervised_counts=counts)
        os.replace(partial, path)
    multihost_utils.sync_global_devices("draft vocabulary written")
    return vocab, counts


def split_held_out(loaded, count: int):
    """(training sources, held-out conversations): the last `count` conversations of the first source are
    kept out of training (a recipe without a held-out file, `data.held_out`)."""
    if count <= 0:
        return loaded, []
    first = loaded[0]
    if len(first.conversations) <= count:
        raise InputError(
            f"data source {first.source.name!r} has {len(first.conversations)} conversations, too few to hold out "
            f"--config.data.held_out_prompts={count}"
        )
    kept = dataclasses.replace(first, conversations=first.conversations[:-count])
    return [kept, *loaded[1:]], first.conversations[-count:]


def load_data(config: ml_collections.ConfigDict):
    """(training sources, held-out conversations) of the recipe's data; the checks that need the data (a bad
    record, a source with no usable conversation, too few to hold out) raise here, before anything is written.
    Conversations containing an evaluation prompt are dropped (`train.data.evaluation_texts`) unless disabled;
    with a held-out file (`data.held_out`), so are those sharing a user turn with it (`exclude_held_out`)."""
    loaded = load_mixture(config.data.sources, None if config.data.exclude_eval_prompts else [])
    if not config.data.held_out:
        return split_held_out(loaded, config.data.held_out_prompts)
    held_out = load_conversations(Source("held_out", config.data.held_out))
    needed = max(config.data.held_out_prompts, 1)
    if len(held_out) < needed:
        raise InputError(
            f"--config.data.held_out {config.data.held_out!r} has {len(held_out)} usable conversations; it needs at "
            f"least {needed} (--config.data.held_out_prompts={config.data.held_out_prompts})"
        )
    return exclude_held_out(loaded, held_out), held_out


def check_before_work(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Every check that needs neither weights nor data (`train.checks.check_recipe`), the mesh against the
    job's devices, and the starting drafter of a fine-tuning run (its config, not its weights)."""
    target = check_recipe(config, workdir)
    try:
        mesh = parallel.make_mesh(config.mesh)
    except ValueError as e:
        raise InputError(f"--config.mesh: {e}") from None
    if mesh.size != jax.device_count():
        raise InputError(
            f"--config.mesh {config.mesh!r} has {mesh.size} devices but the job has {jax.device_count()}: "
            "set it so that data x fsdp x model covers every device"
        )
    batch_size = config.train.batch_size
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % jax.process_count() or batch_size % shards:
        raise InputError(
            f"--config.train.batch_size {batch_size} must divide over {jax.process_count()} processes and the "
            f"data x fsdp = {shards} batch shards of mesh {config.mesh!r}"
        )
    layers = parse_layers(config.train.init_layers)
    if layers is not None and not config.train.init_from:
        raise InputError("--config.train.init_layers cuts the drafter of --config.train.init_from: set it too")
    if config.train.init_from:
        starting_drafter(config.train.init_from, drafter_from_recipe(config, target=target), layers)


def setup(config: ml_collections.ConfigDict, workdir: str, loaded, held_out_conversations) -> Run:
    """Load the target and the draft vocabulary for the loaded data; build the data iterator (not yet
    restored)."""
    log.info("loading the target %s", config.target.path)
    target, target_params, tokenizer = load_target_and_tokenizer(config.target.path)
    if target.scan_layers is None and jax.default_backend() == "cpu":
        # The frozen target runs on XLA's dots here (its params are sharded, not packed for the CPU kernel), where
        # calling the layers one by one is the faster: SmolLM2 over 4 x 1024 tokens in 8.58-8.80 s against
        # 9.08-9.29 s scanned (two interleaved runs), for 3.7-5.5 s of compiling against 1.1-1.5 s, once a run.
        target = target.replace(scan_layers=False)
    # fp32 master parameters (and so fp32 optimiser moments) whatever the compute dtype.
    drafter = drafter_from_recipe(config, target=target).replace(param_dtype=jnp.float32)
    mesh = parallel.make_mesh(config.mesh)
    target_params = parallel.shard_params(target_params, mesh, target.head_dim)  # the one copy the job keeps
    tau_conversations = held_out_conversations[: config.data.held_out_prompts]
    held_out = [chat_prompt_ids(tokenizer, user_texts(c.messages)[0]) for c in tau_conversations]
    given_vocab = None
    if config.train.init_from:
        given_vocab = starting_drafter(config.train.init_from, drafter, parse_layers(config.train.init_layers))[1]
    vocab, supervised = draft_vocabulary(workdir, loaded, tokenizer, target, drafter, config.data, given_vocab)
    iterator = recipe_iterator(loaded, tokenizer, config, drafter.num_drafts + 1)  # anchor + k drafted tokens
    held_out_batches = fixed_batches(held_out_conversations, tokenizer, config, drafter.num_drafts + 1, mesh)
    families = family_batches(held_out_conversations, tokenizer, config, drafter.num_drafts + 1, mesh)
    report = {
        "sources": [
            {
                "name": s.source.name,
                "location": s.source.location,
                "weight": s.source.weight,
                "conversations": len(s.conversations),
                "excluded_eval_prompts": s.num_excluded,
                "excluded_held_out_prompts": s.num_held_out,
                **source_fingerprint(s.source),
            }
            for s in loaded
        ],
        "held_out": [c.id for c in held_out_conversations],
        "held_out_families": {name: sum(c.family == name for c in held_out_conversations) for name in families},
        "held_out_file": source_fingerprint(Source("held_out", config.data.held_out)) if config.data.held_out else None,
        "vocab_sample_supervised_tokens": int(supervised.sum()),
        "draft_vocab_coverage": float(supervised[np.asarray(vocab.d2t)].sum() / max(supervised.sum(), 1)),
        "init_from": config.train.init_from,
    }
    return Run(
        config,
        workdir,
        target,
        target_params,
        tokenizer,
        drafter,
        vocab,
        mesh,
        iterator,
        held_out,
        held_out_batches,
        report,
        families,
    )


# The seed that packs and anchors the held-out batches: fixed, so that a run with another `data.seed` measures the
# same held-out rows (0: what every run measured while the held-out batches followed `data.seed`, which was 0).
HELD_OUT_SEED = 0


def recipe_iterator(data, tokenizer, config: ml_collections.ConfigDict, block_size: int, seed: int | None = None):
    """This process's packed, anchored batches of `data` as the recipe sets them (`data.seq_len`, `max_anchors`,
    `train.batch_size`, and `seed`, default `data.seed`): the training stream and the held-out batches are packed
    the same way."""
    return make_train_iterator(
        data,
        tokenizer,
        seq_len=config.data.seq_len,
        batch_size=config.train.batch_size,
        max_anchors=config.data.max_anchors,
        block_size=block_size,
        seed=config.data.seed if seed is None else seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def fixed_batches(
    conversations, tokenizer, config: ml_collections.ConfigDict, block_size: int, mesh, count: int | None = None
) -> list:
    """The first `count` (default `data.held_out_batches`) global batches (dicts of BATCH_KEYS arrays
    `[batch_size, ...]`, placed on the mesh) of `conversations` packed and anchored like training data, with
    `HELD_OUT_SEED` whatever `data.seed` is: the same batches at every evaluation, on resume, and in runs that
    draw their training data in another order (their held-out numbers compare). Conversations repeat only when the
    batches need more rows than they fill; none without conversations."""
    if not conversations:
        return []
    iterator = recipe_iterator(conversations, tokenizer, config, block_size, seed=HELD_OUT_SEED)
    count = config.data.held_out_batches if count is None else count
    return [global_batch(mesh, next(iterator)) for _ in range(count)]


def family_batches(conversations, tokenizer, config: ml_collections.ConfigDict, block_size: int, mesh) -> dict:
    """{family: its `data.held_out_family_batches` fixed batches} for held-out conversations that name at least
    two families (`Conversation.family`, in order of first appearance); {} otherwise or when that count is 0."""
    groups = {}
    for c in conversations:
        groups.setdefault(c.family, []).append(c)
    if len(groups) < 2 or "" in groups or not config.data.held_out_family_batches:
        return {}
    count = config.data.held_out_family_batches
    return {name: fixed_batches(group, tokenizer, config, block_size, mesh, count) for name, group in groups.items()}


def initial_params(run: Run, resuming: bool) -> dict:
    """Fresh drafter params, sharded over fsdp: the starting drafter's in a fine-tuning run (`train.init_from`),
    else initialised (embeddings from the target). A resuming run only needs their shapes and placement (the
    checkpoint replaces the values), so it never reads the starting drafter's weights."""
    key = jax.random.key(run.config.train.seed)
    if run.config.train.init_from and not resuming:
        layers = parse_layers(run.config.train.init_layers)
        params = starting_params(run.config.train.init_from, run.drafter, run.target_params, run.vocab, layers)
    else:
        params = init_from_target(init_drafter(run.drafter, key), run.drafter, run.target_params, run.vocab)
    return parallel.shard_params(params, run.mesh, run.target.head_dim, fsdp=True)


def global_batch(mesh: jax.sharding.Mesh, local: dict) -> dict:
    """This process's rows of a batch -> global arrays, batch split over data x fsdp."""
    out = {}
    for key in BATCH_KEYS:
        value = np.asarray(local[key])
        shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
        out[key] = jax.make_array_from_process_local_data(parallel.batch_sharding(mesh, shape), value, shape)
    return out


def real_tau(run: Run, params: dict) -> dict:
    """Greedy draft-and-verify on the held-out prompts with the engine, on the training mesh (every process runs
    it with the same prompts): tau and acceptance by position."""
    tokens, lengths = pad_batch(run.held_out, pad_id=run.target.eos_token_ids[0])
    gen = speculative_generate(
        Bundle(run.target_params, run.target, params, run.drafter, run.vocab),
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        max_new_tokens=run.config.train.eval_max_new_tokens,
        eos_ids=run.target.eos_token_ids,
        pad_id=run.target.eos_token_ids[0],
        mesh=run.mesh,
    )
    rates = gen.stats.acceptance_by_position()
    return {"tau": gen.stats.tau(), **{f"accept_{i + 1}": r for i, r in enumerate(rates) if r == r}}


def pooled_metrics(evaluate, params: dict, target_params: dict, vocab, batches: list, weights) -> dict:
    """The training path's metrics (`train.losses.loss_from_sums`: loss terms, per-slot agreement `acc_k` and
    acceptance probability `overlap_k`, simulated accept length) of `params` on `batches`, no update, pooled over
    all of them, as host floats. `evaluate`: `train.step.eval_sums_fn`."""
    sums = [evaluate(params, target_params, vocab, batch) for batch in batches]
    _, metrics = loss_from_sums(jax.tree.map(lambda *xs: sum(xs), *sums), weights)
    return scalars(metrics)


FAMILY_METRICS = ("acc_1", "sim_accept_len")  # what is logged per held-out family


def held_out_metrics(run: Run, evaluate, params: dict, weights) -> dict:
    """`pooled_metrics` on the run's fixed held-out batches, each name prefixed `heldout_`; per held-out family
    (`Run.held_out_families`) its slot-1 agreement and simulated accept length, `heldout_<family>_acc_1` and
    `heldout_<family>_sim_accept_len`."""
    metrics = pooled_metrics(evaluate, params, run.target_params, run.vocab, run.held_out_batches, weights)
    out = {f"heldout_{name}": value for name, value in metrics.items()}
    for family, batches in run.held_out_families.items():
        own = pooled_metrics(evaluate, params, run.target_params, run.vocab, batches, weights)
        out.update({f"heldout_{family}_{name}": own[name] for name in FAMILY_METRICS})
    return out


def evaluation(run: Run, evaluate, params: dict, weights) -> dict:
    """What an evaluation step logs: the held-out training-path metrics and the engine's real tau, each when the
    run has their data (held-out batches, held-out prompts)."""
    out = held_out_metrics(run, evaluate, params, weights) if run.held_out_batches else {}
    return {**out, **(real_tau(run, params) if run.held_out else {})}


def host_params(params: dict) -> dict:
    """The full parameter values on this host (gathered from every process when sharded across them)."""
    if jax.process_count() > 1:
        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


def export_drafter(run: Run, params: dict, step: int, metrics: dict) -> None:
    """Write `workdir/drafter` (replacing the previous export only once the new one is complete), with
    `training.json` beside the weights: the step, the recipe, the data record and the last logged metrics."""
    params = host_params(params)
    rows = host_params(target_lm_head(run.target_params, run.drafter, run.vocab))  # lm_head left out if equal
    if jax.process_index() != 0:
        return
    final = os.path.join(run.workdir, "drafter")
    fresh, old = final + ".new", final + ".old"
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    save_drafter(fresh, params, run.drafter, run.vocab, target_rows=rows)
    record = {"step": step, "recipe": run.config.to_dict(), "data": run.data_report, "metrics": metrics}
    # Data files under the repository are recorded relative to it (`data/...`), as a shipped drafter shows them.
    with open(os.path.join(fresh, TRAINING_RECORD), "w") as f:
        f.write(portable(json.dumps(record, indent=2, default=str), REPOSITORY))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(fresh, final)
    shutil.rmtree(old, ignore_errors=True)


def scalars(metrics: dict) -> dict:
    """Device metrics -> flat host floats (per-slot arrays become name_1 .. name_k)."""
    out = {}
    for name, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        if value.ndim == 0:
            out[name] = float(value)
        else:
            out.update({f"{name}_{i + 1}": float(v) for i, v in enumerate(value)})
    return out


def _logged_step(line: str) -> int | None:
    """The step of a metrics.jsonl line, None for a line cut short by a kill."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


EVAL_SCALARS = ("tau", "accept_", "heldout_")  # `real_tau` (the engine) and `held_out_metrics` (training path)


def scalar_tag(name: str) -> str:
    """TensorBoard's tag of a logged value: `eval/` for the held-out measurements, `train/` for the rest."""
    return f"eval/{name}" if name.startswith(EVAL_SCALARS) else f"train/{name}"


class MetricsLog:
    """metrics.jsonl (truncated to the resumed step, so a resumed run's log has each step once; emptied when a run
    starts from step 0) and TensorBoard. Step 0, when logged, holds the starting drafter's evaluation only."""

    def __init__(self, workdir: str, resume_step: int):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.active = jax.process_index() == 0
        if not self.active:
            return
        kept = []
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if _logged_step(line) is not None and _logged_step(line) <= resume_step]
        partial = self.path + ".partial"
        with open(partial, "w") as f:
            f.writelines(kept)
        os.replace(partial, self.path)
        self.events = EventWriter(workdir)

    def write(self, step: int, values: dict) -> None:
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        self.events.scalars(step, {scalar_tag(name): value for name, value in values.items()})

    def close(self) -> None:
        if self.active:
            self.events.close()


def checkpoint_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
    """Two items per step: `state` (the TrainState pytree) and `data` (the Grain iterator's position)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()}
    return ocp.CheckpointManager(os.path.join(workdir, "checkpoints"), options=options, item_handlers=handlers)


def lock_workdir(workdir: str):
    """Hold `workdir/train.lock` for the life of the job (process 0 only: one job, many processes); a second
    job on the same work directory is an error naming the one that holds it (two jobs would interleave their
    checkpoints and metrics). The lock is the kernel's: it goes with the process, even after a kill -9."""
    os.makedirs(workdir, exist_ok=True)
    handle = open(os.path.join(workdir, "train.lock"), "a+")  # noqa: SIM115 (held open until the process exits)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise InputError(f"work directory {workdir} is in use by another training job (pid {holder})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def empty_file(step_dir: str) -> str | None:
    """An empty file of a checkpoint step (a write cut short: a whole checkpoint has none), else None."""
    for root, _, files in sorted(os.walk(step_dir)):
        for name in sorted(files):
            if os.path.getsize(os.path.join(root, name)) == 0:
                return os.path.join(root, name)
    return None


def named_file(step_dir: str, error: BaseException) -> str:
    """The file of a checkpoint step that a failed restore's error names, else the step directory."""
    for cause in causes(error):
        for word in str(cause).replace('"', " ").replace("'", " ").split():
            if word.startswith(step_dir + os.sep):
                return word.rstrip(".,:;)")
    return step_dir


def restore_damage(manager: ocp.CheckpointManager, step: int, step_dir: str, args) -> tuple[dict | None, str]:
    """(restored items, "") of a whole checkpoint, or (None, "FILE: what is wrong") of a damaged one. An empty file
    is found before Orbax reads anything (its failed reads leave tracebacks from background threads)."""
    empty = empty_file(step_dir)
    if empty is not None:
        return None, f"{empty}: empty file"
    try:
        return manager.restore(step, args=args), ""
    except Exception as e:  # any failure to read a checkpoint of the checked recipe is damage
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"{named_file(step_dir, e)}: {reason if len(reason) <= 160 else reason[:160] + '...'}"


def restore_latest(workdir: str, manager: ocp.CheckpointManager, run: Run, state: TrainState):
    """(manager, state, step) of the latest checkpoint that restores; (manager, state, 0) with none. A damaged
    checkpoint (a file cut short or unreadable: the recipe was checked already) is moved, not deleted, to
    `workdir/damaged/STEP`, with a warning naming it, and the one before it restored; an error when none is
    left."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(run.iterator)
    )
    while (step := manager.latest_step()) is not None:
        step_dir = os.path.join(workdir, "checkpoints", str(step))
        restored, damage = restore_damage(manager, step, step_dir, args)
        if restored is not None:
            log.info("resumed from step %d", step)
            return manager, restored["state"], step
        earlier = [s for s in manager.all_steps() if s < step]
        if not earlier:
            raise InputError(
                f"checkpoint step {step} is damaged ({damage}) and no earlier one is left: move {step_dir} away "
                "to start over, or use a new --workdir"
            )
        aside = os.path.join(workdir, "damaged", str(step))
        multihost_utils.sync_global_devices(f"checkpoint {step} found damaged")
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            os.replace(step_dir, aside if not os.path.exists(aside) else f"{aside}-{int(time.time())}")
        multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
        print(
            f"warning: checkpoint step {step} is damaged ({damage}); moved it to {aside} and resuming from step "
            f"{max(earlier)}",
            file=sys.stderr,
        )
        manager.close()
        manager = checkpoint_manager(workdir, run.config.train.keep_checkpoints)
    return manager, state, 0


def logged_and_evaluated(step: int, train) -> tuple[bool, bool]:
    """(whether `step` writes a metrics record, whether it evaluates on the held-out set) for the recipe's `train`
    section: records every `log_every` steps, evaluations every `eval_every` (0: none), both at the last step; an
    evaluation step always writes its record, whether or not `log_every` divides it."""
    last = step == train.num_steps
    evaluating = bool(train.eval_every) and (step % train.eval_every == 0 or last)
    return evaluating or last or step % train.log_every == 0, evaluating


def save_step(manager: ocp.CheckpointManager, run: Run, state: TrainState, step: int, metrics: dict) -> None:
    """Checkpoint `step` (the training state and the data iterator's position; complete when this returns) and
    export the drafter as of that step."""
    manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(run.iterator)),
    )
    manager.wait_until_finished()
    export_drafter(run, state.params, step, metrics)


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (how a scheduler says a job is about to be preempted) ask training to stop after
    the step under way; `requested()`, asked once after every step, says whether to save that step and stop there.
    Stopping between steps keeps every checkpoint, export and metrics write whole (an interrupt inside Orbax's
    writer left its threads failing at exit). One process: the first signal is noted, a second stops at once with a
    `KeyboardInterrupt`. Many processes must all stop after the same step, so there the answer is JAX's preemption
    sync point: a SIGTERM to any process reaches every process (JAX's own handler), which agree to stop after the
    step that follows the furthest one's (counted from this run's start, so also when resuming or when the signal
    came before the first step); a first Ctrl-C is handed on to it as a SIGTERM to its own process. The handlers
    are installed when it is made; `restore` puts the previous ones back."""

    def __init__(self):
        self.many = jax.process_count() > 1
        self.received = False
        self.steps = 0
        signums = (signal.SIGINT,) if self.many else (signal.SIGINT, signal.SIGTERM)
        self.previous = {signum: signal.signal(signum, self._handle) for signum in signums}

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = True
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(
            f"\n{name}: stopping after this step, saving it (Ctrl-C again to stop at once)", file=sys.stderr, flush=True
        )
        if self.many:
            os.kill(os.getpid(), signal.SIGTERM)

    def requested(self) -> bool:
        """Whether to save the step just taken and stop; in a job of many processes, asked after every step by each."""
        self.steps += 1
        if self.many:
            return multihost_utils.reached_preemption_sync_point(self.steps)
        return self.received


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """The whole job; returns the last logged metrics (and the last real tau when measured). Checks the recipe
    before any work and the data before anything is written. A Ctrl-C or SIGTERM (`StopSignals`) saves the step under
    way and stops it with a `KeyboardInterrupt` whose message says where (the checkpoints are whole: each is written
    aside and renamed when complete)."""
    from tqdm import tqdm

    workdir = os.path.abspath(workdir)
    check_before_work(config, workdir)
    log.info("reading the training data: %s", config.data.sources)
    loaded, held_out_conversations = load_data(config)
    lock = lock_workdir(workdir) if jax.process_index() == 0 else None  # noqa: F841 (held while training)
    if jax.process_index() == 0:
        record_recipe(config, workdir)
    run = setup(config, workdir, loaded, held_out_conversations)
    tc = config.train
    log.info("building the drafter and its optimiser")
    manager = checkpoint_manager(workdir, tc.keep_checkpoints)
    resuming = manager.latest_step() is not None
    params = initial_params(run, resuming)
    optimizer, schedule = make_optimizer(tc, params, run.drafter)
    state = fresh_state(params, optimizer, run.config.train.seed, run.mesh)
    manager, state, start = restore_latest(workdir, manager, run, state)
    weights = recipe_weights(run.drafter.kind, tc.gamma, **tc.loss.to_dict())
    step_config = StepConfig(run.target, run.drafter, weights, tc.anchors_per_chunk)
    step_fn = make_train_step(step_config, optimizer, schedule, run.mesh, jax.tree.map(lambda x: x.sharding, state))
    evaluate = eval_sums_fn(step_config)
    metrics_log = MetricsLog(workdir, start)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "data.json"), "w") as f:
            json.dump(run.data_report, f, indent=2)
    if start == 0 and tc.eval_every and (run.held_out_batches or run.held_out):
        metrics_log.write(0, evaluation(run, evaluate, state.params, weights))  # the learning curve's origin
    last: dict = {}
    tokens_done, clock = 0, time.perf_counter()
    done, bar, stop = start, None, None
    try:
        bar = tqdm(total=tc.num_steps, initial=start, desc="train", disable=jax.process_index() != 0)
        stop = StopSignals()
        for step in range(start + 1, tc.num_steps + 1):
            local = next(run.iterator)
            state, metrics = step_fn(state, run.target_params, run.vocab, global_batch(run.mesh, local))
            done = step
            tokens_done += int(np.sum(np.asarray(local["doc_ids"]) >= 0)) * jax.process_count()
            logging, evaluating = logged_and_evaluated(step, tc)
            if logging:
                last = scalars(metrics)
                elapsed = time.perf_counter() - clock
                last["tokens_per_s"] = tokens_done / elapsed
                tokens_done, clock = 0, time.perf_counter()
                if evaluating:
                    last.update(evaluation(run, evaluate, state.params, weights))
                    clock = time.perf_counter()  # evaluation is not training time
                metrics_log.write(step, last)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
            bar.update(1)
            stopping = stop.requested()
            if stopping or step % tc.checkpoint_every == 0 or step == tc.num_steps:
                save_step(manager, run, state, step, last)
            if stopping:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        saved = manager.latest_step()
        where = f"step {saved} in {os.path.join(workdir, 'checkpoints')}" if saved is not None else "none yet"
        raise KeyboardInterrupt(
            f"stopped after step {done} of {tc.num_steps}; last checkpoint: {where}; run the same command to resume"
        ) from None
    finally:  # the writers' threads would keep an interrupted process alive
        if stop is not None:
            stop.restore()
        if bar is not None:
            bar.close()
        metrics_log.close()
        manager.close()
    return {"resumed_from": start, **last}
