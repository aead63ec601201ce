"""GRPO rewards and advantages on the host (numpy), TRL semantics (GRPOTrainer).

A generation batch holds ``B`` completions (B = B_gen, over all ranks) in global order, so rows
``kG … kG+G−1`` are prompt k's group. ``W`` reward functions score every completion; None
becomes NaN. Rows where every function is NaN are *unscorable*: their reward is NaN, they are
left out of every nan-aware statistic, and their advantage is 0.

Every std here is nan-aware with Bessel's correction (n − 1), NaN with fewer than 2 values.
Statistics never mix generation batches. Arithmetic is float64; advantages come out float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS = 1e-4  # TRL's std offset: A = (r − mean) / (std + 1e-4)
ZERO_STD_ATOL = 1e-8  # |σ| ≤ this counts as zero std (torch.isclose(σ, 0) in TRL)
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Nan-aware std with Bessel's correction; NaN where fewer than 2 values are present."""
    x = np.asarray(x, dtype=np.float64)
    n = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    mean = np.nansum(x, axis=axis, keepdims=True) / np.maximum(n, 1)
    var = np.nansum((x - mean) ** 2, axis=axis, keepdims=True) / np.maximum(n - 1, 1)
    std = np.where(n >= 2, np.sqrt(var), np.nan)
    return std.reshape(()) if axis is None else np.squeeze(std, axis=axis)


def _nanmean(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Nan-aware mean, NaN (without a warning) where no value is present."""
    n = np.sum(~np.isnan(x), axis=axis)
    return np.where(n > 0, np.nansum(x, axis=axis) / np.maximum(n, 1), np.nan)


def resolve_scale_rewards(scale_rewards: str | bool) -> str:
    """True → "group", False → "none"; strings must be one of ``SCALE_REWARDS``."""
    if scale_rewards is True:
        return "group"
    if scale_rewards is False:
        return "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(
            f"scale_rewards={scale_rewards!r} is invalid: use one of "
            f"{', '.join(map(repr, SCALE_REWARDS))}, True or False"
        )
    return scale_rewards


def _groups(x_B: np.ndarray, num_generations: int) -> np.ndarray:
    """[B] → [B/G, G], with a clear error when B is not a whole number of groups."""
    if (
        isinstance(num_generations, bool)
        or int(num_generations) != num_generations
        or num_generations < 1
    ):
        raise ValueError(f"num_generations={num_generations!r} is invalid: use an integer ≥ 1")
    if x_B.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {x_B.shape}")
    if x_B.shape[0] % num_generations != 0:
        raise ValueError(
            f"len(rewards)={x_B.shape[0]} is not a multiple of "
            f"num_generations={num_generations}: a generation batch holds whole "
            "prompt groups"
        )
    return x_B.reshape(-1, int(num_generations))


def _group_stats(x_B: np.ndarray, num_generations: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row group nanmean and nanstd, broadcast back to [B]."""
    x_QG = _groups(x_B, num_generations)
    g = x_QG.shape[1]
    mean_B = np.repeat(_nanmean(x_QG, axis=1), g)
    std_B = np.repeat(nanstd(x_QG, axis=1), g)
    return mean_B, std_B


def _reward_sigma(rewards_B: np.ndarray, num_generations: int, scale_rewards: str) -> np.ndarray:
    """σ per row: group std for group/none, batch std for batch (docs/algorithms/grpo.md §6)."""
    _, std_grp_B = _group_stats(rewards_B, num_generations)
    if scale_rewards == "batch":
        return np.full_like(rewards_B, nanstd(rewards_B))
    return std_grp_B


ESTIMATORS = ("grpo", "rloo", "reinforce_pp")


def grpo_advantages(
    rewards: np.ndarray,
    num_generations: int,
    scale_rewards: str | bool = "group",
    estimator: str = "grpo",
) -> np.ndarray:
    """Advantages of aggregated rewards ``[B]`` (NaN allowed) → float32 ``[B]``.

    ``estimator`` (``grpo.advantage_estimator``):

    - ``grpo`` (TRL): r − mean_grp, scaled by ``scale_rewards``: ``group`` ÷ (std_grp + 1e-4),
      ``batch`` ÷ (std_all + 1e-4), ``none`` unscaled.
    - ``rloo`` (REINFORCE leave-one-out, Ahmadian et al. 2024; TRL's RLOOTrainer with
      ``normalize_advantages=False``): r_i − mean of the group's *other* scored rewards
      = n/(n−1) · (r_i − mean_grp) for n scored rows in the group. Unscaled.
    - ``reinforce_pp`` (REINFORCE++, Hu 2025, outcome rewards): the batch-normalised reward
      (r − mean_all) / (std_all + 1e-4), no per-prompt baseline; its KL-in-reward option
      (``grpo.kl_in_reward``) makes per-token advantages instead: :func:`kl_in_reward_advantages`.

    ``scale_rewards`` is GRPO's normalisation; ``rloo`` and ``reinforce_pp`` define their own
    and reject any value but the default. NaN results (unscorable rows, groups with fewer than
    2 scored rewards where a group statistic is needed) become 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"advantage_estimator={estimator!r} is invalid: use one of "
            f"{', '.join(map(repr, ESTIMATORS))}"
        )
    scale_rewards = resolve_scale_rewards(scale_rewards)
    if estimator != "grpo" and scale_rewards != "group":
        raise ValueError(
            f"scale_rewards={scale_rewards!r} applies to advantage_estimator='grpo' only: "
            f"{estimator} scales its advantages its own way; remove scale_rewards"
        )
    r_B = np.asarray(rewards, dtype=np.float64)
    mean_B, std_grp_B = _group_stats(r_B, num_generations)
    if estimator == "rloo":
        n_B = np.repeat(np.sum(~np.isnan(_groups(r_B, num_generations)), axis=1), num_generations)
        with np.errstate(divide="ignore", invalid="ignore"):
            adv_B = np.where(n_B >= 2, (r_B - mean_B) * n_B / (n_B - 1), np.nan)
    elif estimator == "reinforce_pp":
        adv_B = (r_B - _nanmean(r_B)) / (nanstd(r_B) + EPS)
    else:
        adv_B = r_B - mean_B
        if scale_rewards == "group":
            adv_B = adv_B / (std_grp_B + EPS)
        elif scale_rewards == "batch":
            adv_B = adv_B / (nanstd(r_B) + EPS)
    return np.nan_to_num(adv_B, nan=0.0).astype(np.float32)


def kl_in_reward_advantages(
    rewards: np.ndarray,
    old_logp: Sequence[np.ndarray],
    ref_logp: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    beta: float,
) -> list[np.ndarray]:
    """REINFORCE++ with the KL penalty in the reward (Hu 2025; OpenRLHF's ``reinforce++``):
    float32 per-token advantages of every completion of one generation batch.

    Row i's completion tokens t get the outcome reward r_i at its last token and
    −β·kl_t on every token, kl_t = old_t − ref_t (the k1 estimate, generating policy against the
    reference); the advantage is the return to go (γ = 1)

        G_t = r_i − β Σ_{s ≥ t} kl_s       (the sum over loss tokens s only)

    whitened over every loss token of the batch: (G_t − mean) / (std + 1e-4), Bessel std.
    Tokens outside the loss mask (``masks`` [0/1] per completion token) and unscorable rows
    (NaN reward) get 0 and stay out of the mean and std.
    """
    r_B = np.asarray(rewards, np.float64)
    returns = []
    for r, old, ref, m in zip(r_B, old_logp, ref_logp, masks, strict=True):
        on = np.asarray(m, np.float64) > 0
        kl = np.where(on, np.asarray(old, np.float64) - np.asarray(ref, np.float64), 0.0)
        to_go = np.cumsum(kl[::-1])[::-1]  # Σ_{s ≥ t} kl_s
        returns.append(np.where(on & ~np.isnan(r), r - beta * to_go, np.nan))
    flat = np.concatenate(returns) if returns else np.zeros(0)
    mean, std = _nanmean(flat), nanstd(flat)
    return [np.nan_to_num((g - mean) / (std + EPS), nan=0.0).astype(np.float32) for g in returns]


def _weights(reward_matrix_BW: np.ndarray, weights: Sequence[float] | None) -> np.ndarray:
    num_funcs = reward_matrix_BW.shape[1]
    if weights is None:
        return np.ones(num_funcs)
    w_W = np.asarray(weights, dtype=np.float64)
    if w_W.shape != (num_funcs,):
        raise ValueError(
            f"reward_weights has {w_W.size} entries for {num_funcs} reward "
            "functions: give one weight per function"
        )
    return w_W


def _weighted_nansum(x_BW: np.ndarray, w_W: np.ndarray) -> np.ndarray:
    """Σ_k w_k x_ik over the non-NaN entries; NaN where the whole row is NaN."""
    unscorable_B = np.all(np.isnan(x_BW), axis=1)
    total_B = np.nansum(x_BW * w_W[None, :], axis=1)
    return np.where(unscorable_B, np.nan, total_B)


def _as_matrix(reward_matrix_BW: np.ndarray) -> np.ndarray:
    x = np.asarray(reward_matrix_BW, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"reward matrix must be 2-D [B, W], got shape {x.shape}")
    return x


def informative_groups(
    reward_matrix_BW: np.ndarray, num_generations: int, weights: Sequence[float] | None = None
) -> np.ndarray:
    """``[Q]`` bool: the prompt groups whose summed rewards vary (DAPO's dynamic-sampling
    filter). A group with σ ≤ 1e-8, or fewer than 2 scored rows (σ NaN), gives every row a zero
    advantage under any estimator: nothing to learn from it."""
    r_B = aggregate_rewards(reward_matrix_BW, weights)  # the weighted sum of the functions
    std_Q = nanstd(_groups(r_B, num_generations), axis=1)
    return std_Q > ZERO_STD_ATOL  # NaN compares False


def aggregate_rewards(
    reward_matrix_BW: np.ndarray,
    weights: Sequence[float] | None = None,
    mode: str = "sum_then_normalize",
    *,
    num_generations: int | None = None,
) -> np.ndarray:
    """Combine ``[B, W]`` per-function rewards into one float64 reward per row ``[B]``.

    ``sum_then_normalize``: r_i = nansum_k w_k r_ik. ``normalize_then_sum`` (needs
    ``num_generations``): z_ik = (r_ik − mean_grp,k) / (std_grp,k + 1e-4), r_i = nansum_k w_k z_ik.
    Unscorable rows (every function NaN) give NaN.
    """
    x_BW = _as_matrix(reward_matrix_BW)
    w_W = _weights(x_BW, weights)
    if mode == "sum_then_normalize":
        return _weighted_nansum(x_BW, w_W)
    if mode != "normalize_then_sum":
        raise ValueError(
            f"multi_objective_aggregation={mode!r} is invalid: use one of "
            f"{', '.join(map(repr, AGGREGATIONS))}"
        )
    if num_generations is None:
        raise ValueError("mode='normalize_then_sum' needs num_generations (group statistics)")
    z_cols = []
    for k in range(x_BW.shape[1]):
        mean_B, std_B = _group_stats(x_BW[:, k], num_generations)
        z_cols.append((x_BW[:, k] - mean_B) / (std_B + EPS))
    z_BW = np.stack(z_cols, axis=1)
    unscorable_B = np.all(np.isnan(x_BW), axis=1)
    return np.where(unscorable_B, np.nan, np.nansum(z_BW * w_W[None, :], axis=1))


def compute_advantages(
    reward_matrix_BW: np.ndarray,
    num_generations: int,
    *,
    weights: Sequence[float] | None = None,
    scale_rewards: str | bool = "group",
    mode: str = "sum_then_normalize",
    estimator: str = "grpo",
) -> np.ndarray:
    """float32 advantages ``[B]`` of one generation batch from its ``[B, W]`` reward matrix.

    ``sum_then_normalize`` → ``grpo_advantages(aggregate, G, scale_rewards, estimator)``;
    ``normalize_then_sum`` (GRPO only) → (r − nanmean_all) / (std_all + 1e-4) of the summed
    z-scores.
    """
    r_B = aggregate_rewards(reward_matrix_BW, weights, mode, num_generations=num_generations)
    if mode == "sum_then_normalize":
        return grpo_advantages(r_B, num_generations, scale_rewards, estimator)
    if estimator != "grpo":
        raise ValueError(
            f"multi_objective_aggregation='normalize_then_sum' is GRPO's; with "
            f"advantage_estimator={estimator!r} use 'sum_then_normalize'"
        )
    resolve_scale_rewards(scale_rewards)  # validated, but this mode always scales by batch
    adv_B = (r_B - _nanmean(r_B)) / (nanstd(r_B) + EPS)
    return np.nan_to_num(adv_B, nan=0.0).astype(np.float32)


def reward_metrics(
    reward_matrices: np.ndarray | Sequence[np.ndarray],
    num_generations: int,
    *,
    weights: Sequence[float] | None = None,
    scale_rewards: str | bool = "group",
    mode: str = "sum_then_normalize",
    reward_names: Sequence[str] | None = None,
) -> dict[str, float]:
    """Generation-side metrics of docs/algorithms/grpo.md §9 over one or several generation batches
    (rows pooled).

    ``reward`` / ``reward_std``: nanmean / nan-aware Bessel std of the weighted reward sum over
    all rows (unscorable rows excluded), whatever ``mode``. ``frac_reward_zero_std``: fraction of
    rows whose σ (computed within the row's own generation batch: group std for group/none,
    batch std for batch and normalize_then_sum) is ≤ 1e-8; NaN σ does not count.
    ``rewards/<name>/mean|std`` per function.
    """
    scale_rewards = resolve_scale_rewards(scale_rewards)
    if mode not in AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation={mode!r} is invalid: use one of "
            f"{', '.join(map(repr, AGGREGATIONS))}"
        )
    if isinstance(reward_matrices, np.ndarray) and reward_matrices.ndim == 2:
        reward_matrices = [reward_matrices]
    mats = [_as_matrix(m) for m in reward_matrices]
    if not mats:
        raise ValueError("reward_metrics needs at least one generation batch")
    num_funcs = mats[0].shape[1]
    if any(m.shape[1] != num_funcs for m in mats):
        raise ValueError("every generation batch must have the same reward functions")
    names = (
        list(reward_names) if reward_names is not None else [f"func_{k}" for k in range(num_funcs)]
    )
    if len(names) != num_funcs:
        raise ValueError(f"{len(names)} reward_names for {num_funcs} reward functions")

    sums, zero_std = [], []
    for x_BW in mats:
        r_B = _weighted_nansum(x_BW, _weights(x_BW, weights))
        sums.append(r_B)
        if mode == "normalize_then_sum":
            r_norm_B = aggregate_rewards(x_BW, weights, mode, num_generations=num_generations)
            sigma_B = np.full_like(r_B, nanstd(r_norm_B))
        else:
            sigma_B = _reward_sigma(r_B, num_generations, scale_rewards)
        zero_std.append(np.abs(sigma_B) <= ZERO_STD_ATOL)  # NaN compares False
    r_all = np.concatenate(sums)
    x_all = np.concatenate(mats, axis=0)
    out = {
        "reward": float(_nanmean(r_all)),
        "reward_std": float(nanstd(r_all)),
        "frac_reward_zero_std": float(np.mean(np.concatenate(zero_std))),
    }
    for k, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(_nanmean(x_all[:, k]))
        out[f"rewards/{name}/std"] = float(nanstd(x_all[:, k]))
    return out
