"""The stack of transformer blocks: unrolled or scanned, with optional rematerialisation.

Two layouts of the same blocks (``ModelConfig.scan_layers``):

- unrolled: ``nnx.List`` of Nl blocks, parameters ``layers.{i}.attn.q_kernel [D, H, Dh]``; the
  forward is a Python loop, so the compiled program holds Nl copies of the block (compile time
  grows with Nl).
- scanned: one block whose every parameter has a leading layer axis,
  ``layers.attn.q_kernel [Nl, D, H, Dh]``, logical axis ``"layers"`` (never sharded:
  ``sharding.py``); the forward is one ``lax.scan`` over it (split / merge of the block's state
  in the body), so the program holds the block once.

Unrolled blocks of one structure can also be traced once (``run_blocks(trace_once=True)``, the
engine's decode model): every block calls one jitted step whose equations are inlined, so Python
traces the block once and the program is still the unrolled one.

:func:`stack_blocks` builds the scanned layout from blocks created one by one, so a seed gives
the same parameters in both layouts; :func:`unstack_blocks` is its inverse. Both layouts run
through :func:`run_blocks`, which is the only place that knows the difference.

ZeRO-3 (``fsdp.py``): when the blocks' Variables are fsdp shards marked for gathering, each
block gathers its weights inside its (scan body's) checkpoint, and no remat setting saves a
gathered weight: ``"none"`` (and ``everything_saveable``, which would keep the gathered
weights' reshapes) becomes "save every matmul output" (``dots_saveable``: weights are matmul
inputs, never outputs), other policies are wrapped by ``fsdp.exclude_gathered``, ``"block"``
saves only the block's input anyway.

Rematerialisation (``ModelConfig.remat``): ``"none"`` keeps every activation the backward
pass needs; ``"block"`` wraps each block in ``jax.checkpoint`` (only its input is saved, the
rest recomputed in the backward pass); any policy name of ``jax.checkpoint_policies`` (e.g.
``dots_with_no_batch_dims_saveable``: keep the matmul outputs, recompute the rest) wraps each
block in ``jax.checkpoint(policy=...)``. Scanned, the checkpoint is inside the scan body, so
the saved residuals are one stacked buffer per saved value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.fsdp import any_marked, exclude_gathered

LAYER_AXIS = "layers"  # logical name of the stacked layer axis (unsharded)
REMAT_OFF, REMAT_BLOCK = "none", "block"
SAVE_EVERYTHING = "everything_saveable"

C = TypeVar("C")
M = TypeVar("M", bound=nnx.Module)


def remat_policy_names() -> tuple[str, ...]:
    """Names in ``jax.checkpoint_policies`` that are policies themselves (not factories such
    as ``save_only_these_names(*names)``, which need arguments)."""
    names = []
    for name in dir(jax.checkpoint_policies):
        value = getattr(jax.checkpoint_policies, name)
        if name.startswith("_") or not callable(value):
            continue
        params = inspect.signature(value).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            names.append(name)
    return tuple(sorted(names))


def check_remat(value: Any, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is ``"none"``, ``"block"`` or a
    policy name of :func:`remat_policy_names`."""
    if value in (REMAT_OFF, REMAT_BLOCK):
        return
    names = remat_policy_names()
    if value not in names:
        raise ValueError(
            f"{field}={value!r} is invalid: use 'none' (no rematerialisation), 'block' "
            f"(jax.checkpoint around each block) or a jax.checkpoint_policies name: "
            f"{', '.join(names)}"
        )


def remat_policy(remat: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy of a valid ``remat`` other than ``"none"`` (None for
    ``"block"``: save nothing but the block's inputs)."""
    return None if remat == REMAT_BLOCK else getattr(jax.checkpoint_policies, remat)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def stack_blocks(blocks: Sequence[M]) -> M:
    """One block holding the Nl blocks' parameters stacked on a new leading ``"layers"`` axis
    (each Variable's ``out_sharding`` gains ``"layers"`` in front)."""
    graphdef, _ = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(b) for b in blocks))

    def relabel(v: nnx.Variable) -> nnx.Variable:
        axes = v.get_metadata().get("out_sharding")
        return v.replace(v.get_value(), out_sharding=(LAYER_AXIS, *axes) if axes else axes)

    return nnx.merge(graphdef, jax.tree.map(relabel, stacked, is_leaf=_is_variable))


def unstack_blocks(stacked: M) -> list[M]:
    """The Nl blocks of a :func:`stack_blocks` block (its inverse)."""
    graphdef, state = nnx.split(stacked)
    n = jax.tree.leaves(state)[0].shape[0]

    def layer(i: int, v: nnx.Variable) -> nnx.Variable:
        axes = v.get_metadata().get("out_sharding")
        return v.replace(v.get_value()[i], out_sharding=tuple(axes[1:]) if axes else axes)

    return [
        nnx.merge(graphdef, jax.tree.map(lambda v, i=i: layer(i, v), state, is_leaf=_is_variable))
        for i in range(n)
    ]


def run_blocks(
    layers: Any,
    step: Callable[..., C],
    carry: C,
    *args: Any,
    scanned: bool,
    remat: str = REMAT_OFF,
    looped: bool = False,
    trace_once: bool = False,
) -> C:
    """``carry = step(block, carry, i, *args)`` for every block in order; the final carry.

    ``layers``: an ``nnx.List`` of blocks (unrolled) or a :func:`stack_blocks` block
    (``scanned``: one ``lax.scan``, ``i`` traced). ``args`` are loop-invariant arrays
    (segment ids, positions). ``remat`` (``"none"``, ``"block"`` or a policy name) wraps each
    step in ``jax.checkpoint``.

    ``looped`` (unrolled blocks of one structure): one ``lax.scan`` over the layer index whose
    step takes block i's weights with ``lax.switch``, a copy of one block's weights per layer
    and no stacked copy of the model. The program holds the block once (a compile as short as
    the scanned layout's) at the cost of that copy: for a one-off pass over many tokens (the
    engine's prefill), not for a loop of decode steps. Blocks of different structures (a MoE
    model with dense layers between), rematerialised or ZeRO-3 blocks (a training forward) run
    unrolled.

    ``trace_once`` (unrolled blocks of one structure, no remat, no ZeRO-3; ``looped`` wins):
    the step is one jitted function with ``inline=True`` that every block calls with its own
    weights and ``i`` traced. Python traces the block once (JAX caches the jaxpr) and each call
    copies its equations into the program, so the program is the unrolled one, equation for
    equation: the same speed and the same numbers. (A call that is not inlined changes them in
    bf16 compute: XLA keeps excess precision differently across a call boundary, log-probs
    1.4e-2 apart.) For the engine's decode model: SmolLM2-135M's 30 layers traced in 0.3-0.4 s
    instead of 1.5-2.0 s.
    """
    zero3 = any_marked(nnx.state(layers))  # ZeRO-3 shards: never save a gathered weight
    if (looped or trace_once) and not scanned and remat == REMAT_OFF and not zero3:
        blocks = [nnx.split(block) for block in layers]
        if _one_structure(blocks):
            return (_looped if looped else _traced_once)(blocks, step, carry, *args)
    if remat == REMAT_OFF and not zero3:
        checkpoint = lambda f: f  # noqa: E731
    else:
        if zero3 and remat in (REMAT_OFF, SAVE_EVERYTHING):
            # "save everything" would keep the gathered weights' reshapes and casts too: save
            # every matmul output instead (weights are matmul inputs, never outputs)
            policy = exclude_gathered(jax.checkpoint_policies.dots_saveable)
        else:
            policy = remat_policy(remat)
            if zero3 and policy is not None:
                policy = exclude_gathered(policy)
        # inside a scan the loop already keeps XLA from merging the recomputation away
        checkpoint = lambda f: jax.checkpoint(f, policy=policy, prevent_cse=not scanned)  # noqa: E731
    if not scanned:
        for i, block in enumerate(layers):
            graphdef, state = nnx.split(block)

            def one(state, carry, *args, graphdef=graphdef, i=i):
                return step(nnx.merge(graphdef, state), carry, i, *args)

            carry = checkpoint(one)(state, carry, *args)
        return carry
    graphdef, stacked = nnx.split(layers)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]

    def body(carry, xs, *args):
        state, i = xs
        return step(nnx.merge(graphdef, state), carry, i, *args)

    def scan_body(carry, xs):
        return checkpoint(body)(carry, xs, *args), None

    carry, _ = jax.lax.scan(scan_body, carry, (stacked, jnp.arange(num_layers, dtype=jnp.int32)))
    return carry


def _one_structure(blocks: list[tuple[Any, Any]]) -> bool:
    """Whether the unrolled blocks (``nnx.split`` of each) share one graph and one parameter
    tree (shapes, dtypes)."""
    if len(blocks) < 2:
        return False
    graphdef, state = blocks[0]
    shape = lambda st: jax.tree.map(lambda x: (x.shape, x.dtype), st)  # noqa: E731
    first = shape(state)
    return all(g == graphdef and shape(st) == first for g, st in blocks[1:])


def _looped(blocks: list[tuple[Any, Any]], step: Callable[..., C], carry: C, *args: Any) -> C:
    graphdef = blocks[0][0]
    states = [state for _, state in blocks]

    def body(carry, i):
        state = jax.lax.switch(i, [lambda s=s: s for s in states])
        return step(nnx.merge(graphdef, state), carry, i, *args), None

    carry, _ = jax.lax.scan(body, carry, jnp.arange(len(states), dtype=jnp.int32))
    return carry


def _traced_once(blocks: list[tuple[Any, Any]], step: Callable[..., C], carry: C, *args: Any) -> C:
    """:func:`run_blocks` with ``trace_once``: the Nl blocks call one inlined jitted step (one
    trace), block i with its own weights and ``i`` as a traced int32."""
    graphdef = blocks[0][0]

    @jax.jit(inline=True)
    def one(state: Any, carry: C, i: jax.Array, *args: Any) -> C:
        return step(nnx.merge(graphdef, state), carry, i, *args)

    for i, (_, state) in enumerate(blocks):
        carry = one(state, carry, jnp.int32(i), *args)
    return carry
