"""The acceptance rule is lossless: emitted tokens have exactly the target law.

Statistical design. A context-independent target with one distribution per absolute output
position, P[t] (so the exact law of the emitted sequence is P[0] x P[1] x ...), and a drafter
with Q[t]. P and Q come from `logits_to_probs` on random logits under different temperature /
top-k / top-p / min-p settings, so both hold zeros, in different places. A vectorised decoder
(vmap + jit, N = 200k independent runs) repeats speculative steps -- draft x_i ~ Q[pos+i],
verify against P[pos : pos+G+1], emit n accepted drafts + 1 token, advance pos by n + 1 -- until
L = 3 tokens are out. The emitted first token, first two and first three tokens are compared with
the exact product law by a chi-square test (cells with expected count < 5 pooled; any count in a
zero-probability cell is an outright failure). The correct rule must give p > 1e-4 on every check;
each deliberately broken rule below must give p < 1e-9 on at least one, so the test has power.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decode.acceptance import accept, accept_row, accept_tree_greedy
from jaxspec.decode.sampling import SamplingParams, draw, logits_to_probs, row_keys

N = 200_000  # independent decodes per check
L = 3  # emitted tokens compared jointly
V, G = 8, 3  # vocabulary, drafts per step
PASS_P = 1e-4  # the correct rule must clear this on every check
FAIL_P = 1e-9  # a broken rule must fall below this on some check


# -- deliberately broken rules ------------------------------------------------------------------

BROKEN = [
    "unclipped_residual",  # p - q without max(0, .)
    "residual_is_p",  # resample from p instead of norm(max(0, p - q))
    "bonus_from_q",  # all accepted: bonus drawn from the draft's last q
    "bonus_from_previous_p",  # all accepted: bonus from p[n-1] (off by one)
    "inverted_ratio",  # u < q/p instead of u < p/q
    "always_accept",
    "ignores_num_proposed",  # accepts padding past num_proposed (token 0 with q = 0)
    "none",  # the same copy without a bug: must pass like accept_row
]


def _broken_rule(draft_tokens, q, p, num_proposed, key, bug):
    """accept_row with BROKEN[bug] switched on. bug is traced, so one compile serves them all."""
    on = lambda name: bug == BROKEN.index(name)  # noqa: E731
    g, v = q.shape
    u = jax.random.uniform(key, (g + 1,))
    tok = jnp.clip(draft_tokens, 0, v - 1)[:, None]
    q_t = jnp.take_along_axis(q, tok, -1)[:, 0]
    p_t = jnp.take_along_axis(p[:g], tok, -1)[:, 0]
    ok = jnp.where(on("inverted_ratio"), u[:g] * p_t < q_t, u[:g] * q_t < p_t)
    ok |= on("always_accept")
    ok &= (jnp.arange(g) < num_proposed) | on("ignores_num_proposed")
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)), dtype=jnp.int32)
    rejected = n < jnp.where(on("ignores_num_proposed"), g, num_proposed)
    q_n = jnp.where(rejected, q[jnp.minimum(n, g - 1)], 0.0)
    p_n = p[n]
    p_n = jnp.where(on("bonus_from_q") & ~rejected, q[g - 1], p_n)
    p_n = jnp.where(on("bonus_from_previous_p") & ~rejected, p[jnp.maximum(n - 1, 0)], p_n)
    resid = jnp.where(on("unclipped_residual"), p_n - q_n, jnp.maximum(p_n - q_n, 0.0))
    resid = jnp.where(on("residual_is_p"), p_n, resid)
    resid = jnp.where(jnp.sum(resid) > 0, resid, p_n)
    return n, draw(u[g], resid)


# -- the simulated decoder ---------------------------------------------------------------------


def _tables(seed, sp_target, sp_draft):
    """P, Q: [L+G, V] per-position target and draft probs from random logits."""
    k_p, k_q = jax.random.split(jax.random.key(seed))
    p = logits_to_probs(2.0 * jax.random.normal(k_p, (L + G, V)), sp_target)
    q = logits_to_probs(2.0 * jax.random.normal(k_q, (L + G, V)), sp_draft)
    return p, q


@jax.jit
def _simulate(rule_id, P, Q, num_range, key):
    """int32[N, L]: first L tokens of N independent speculative decodes.

    rule_id -1 runs jaxspec's accept_row, otherwise _broken_rule with bug BROKEN[rule_id]. Each
    step proposes num ~ U{num_range[0]..num_range[1]} drafts. Everything but the shapes is
    traced, so one compile serves every config and rule (rule_id is not vmapped, so the cond
    runs only the chosen rule)."""
    ar_g, ar_l = jnp.arange(G), jnp.arange(L)

    def step(carry, rand):  # every step emits >= 1 token, so L steps are enough
        out, pos = carry
        u, k_a = rand  # [G*V + 1] uniforms for the drafter, a key for the rule
        q = Q[jnp.minimum(pos + ar_g, L + G - 1)]  # [G, V]; clamped only once L tokens are out
        gumbel = -jnp.log(-jnp.log(u[:-1].reshape(G, V)))
        x = jnp.argmax(jnp.log(q) + gumbel, axis=-1)  # x_i ~ q_i (Gumbel-max), [G]
        span = num_range[1] - num_range[0] + 1
        num = num_range[0] + jnp.minimum((u[-1] * span).astype(jnp.int32), span - 1)
        pad = ar_g >= num  # padding a short drafter leaves: token 0 with all-zero q
        x = jnp.where(pad, 0, x)
        q = jnp.where(pad[:, None], 0.0, q)
        p = P[jnp.minimum(pos + jnp.arange(G + 1), L + G - 1)]  # [G+1, V]
        acc, nxt = jax.lax.cond(
            rule_id < 0,
            lambda *a: accept_row(*a),
            lambda *a: _broken_rule(*a, rule_id),
            x, q, p, num, k_a,
        )
        seq = jnp.where(jnp.arange(G + 1) < acc, jnp.append(x, 0), nxt)  # emitted: [:acc+1]
        i = ar_l - pos
        out = jnp.where((i >= 0) & (i <= acc), seq[jnp.clip(i, 0, G)], out)
        return (out, pos + acc + 1), None

    def one(u, keys):
        init = (jnp.zeros(L, jnp.int32), jnp.int32(0))
        return jax.lax.scan(step, init, (u, keys))[0][0]

    # Drafter randomness drawn in bulk outside the vmap: vmapped threefry is slow to compile.
    k_u, k_r = jax.random.split(key)
    u = jax.random.uniform(k_u, (N, L, G * V + 1), minval=jnp.finfo(jnp.float32).tiny)
    return jax.vmap(one)(u, jax.random.split(k_r, (N, L)))


def _chi2_pvalue(counts, probs):
    """Chi-square goodness of fit; cells with expected < 5 pooled. 0.0 if a p=0 cell is hit."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = counts.sum() * probs / probs.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chi2.sf(((obs - exp) ** 2 / exp).sum(), len(obs) - 1))


def _check(tokens, P):
    """p-values (and total variation) of the first 1, 2, 3 emitted tokens vs the exact law."""
    tokens, P = np.asarray(tokens), np.asarray(P, np.float64)
    P = P / P.sum(-1, keepdims=True)
    v = P.shape[-1]
    if tokens.min() < 0 or tokens.max() >= v:  # a broken rule may emit garbage ids
        return {m: (0.0, 1.0) for m in range(1, L + 1)}
    res = {}
    for m in range(1, L + 1):
        exact = functools.reduce(np.multiply.outer, list(P[:m])).ravel()  # P[0] x ... x P[m-1]
        cell = np.ravel_multi_index(tuple(tokens[:, :m].T), (v,) * m)
        counts = np.bincount(cell, minlength=v**m)
        tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
        res[m] = (_chi2_pvalue(counts, exact), tv)
    return res


CONFIGS = {
    # name: (seed, target params, draft params, num_proposed range)
    "topk_target_topp_draft": (0, dict(temperature=0.8, top_k=4),
                               dict(temperature=1.3, top_p=0.8), (G, G)),
    "short_proposals": (1, dict(temperature=1.0, top_p=0.9, min_p=0.05),
                        dict(temperature=0.7, top_k=5), (0, G)),
    "same_params": (2, dict(temperature=0.9, top_k=5, top_p=0.95),
                    dict(temperature=0.9, top_k=5, top_p=0.95), (2, 2)),
    "one_hot_draft": (3, dict(temperature=1.5, top_k=6), dict(temperature=0.0), (1, G)),
}


def _run(name, rule_id):
    seed, sp_t, sp_d, num_range = CONFIGS[name]
    P, Q = _tables(seed, SamplingParams.make(**sp_t), SamplingParams.make(**sp_d))
    assert (P == 0).any() and (Q == 0).any()
    key = jax.random.key(100 + seed)
    return _check(_simulate(jnp.int32(rule_id), P, Q, jnp.asarray(num_range, jnp.int32), key), P)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_emitted_tokens_have_target_law(name):
    res = _run(name, -1)
    for m, (pval, tv) in res.items():
        assert pval > PASS_P, f"first {m} tokens: p={pval:.2e} tv={tv:.4f}"
        assert tv < 0.02


# Each broken rule against a config where its bug shows within L tokens (a bonus bug needs
# "all proposed accepted" to be common and the bonus to fall within the first L tokens).
BROKEN_CASES = {
    "unclipped_residual": "same_params",
    "residual_is_p": "short_proposals",
    "bonus_from_q": "one_hot_draft",
    "bonus_from_previous_p": "same_params",
    "inverted_ratio": "one_hot_draft",
    "always_accept": "same_params",
    "ignores_num_proposed": "short_proposals",
}


@pytest.mark.parametrize("bug,name", list(BROKEN_CASES.items()))
def test_check_rejects_broken_rule(bug, name):
    res = _run(name, BROKEN.index(bug))
    assert min(pval for pval, _ in res.values()) < FAIL_P, res


def test_reference_copy_without_bug_passes():
    """The broken variants differ from a correct rule only by their bug."""
    res = _run("short_proposals", BROKEN.index("none"))
    assert min(pval for pval, _ in res.values()) > PASS_P, res


# -- edge cases: few shapes, so a handful of compiles serves them all ----------------------------

G_E, V_E, B_E, DRAWS = 3, 6, 256, 20_000


@functools.partial(jax.jit, static_argnums=1)
def _random_probs(key, shape, sp):
    return logits_to_probs(2.0 * jax.random.normal(key, shape), sp)


def _probs(seed, **sp):  # f32[G_E + 1, V_E]
    return np.asarray(_random_probs(jax.random.key(seed), (G_E + 1, V_E), SamplingParams.make(**sp)))


@jax.jit
def _row_draws(tokens, q, p, num):
    """DRAWS independent runs of accept_row on one row: (n int32[DRAWS], next int32[DRAWS])."""
    keys = jax.random.split(jax.random.key(0), DRAWS)
    return jax.vmap(accept_row, in_axes=(None, None, None, None, 0))(tokens, q, p, num, keys)


def _draws(tokens, q, p, num):
    n, nxt = _row_draws(jnp.asarray(tokens, jnp.int32), jnp.asarray(q, jnp.float32),
                        jnp.asarray(p, jnp.float32), jnp.int32(num))
    return np.asarray(n), np.asarray(nxt)


_accept = jax.jit(accept)  # always called on [B_E, ...]


def _rows(x):
    return np.broadcast_to(x, (B_E,) + np.shape(x))


def test_all_accepted_bonus_from_last_p():
    p = _probs(10, temperature=1.0)
    n, nxt = _draws([1, 4, 2], p[:G_E], p, G_E)  # q == p: every draft accepted
    assert np.all(n == G_E)
    counts = np.bincount(nxt, minlength=V_E)
    assert _chi2_pvalue(counts, p[G_E]) > PASS_P
    assert _chi2_pvalue(counts, p[G_E - 1]) < FAIL_P  # and not some other row


def test_q_equals_p_accepts_everything_proposed():
    p = _probs(11, temperature=0.8, top_k=4)
    rng = np.random.default_rng(0)
    tokens = np.stack([rng.choice(V_E, B_E, p=row / row.sum()) for row in p[:G_E]], -1)  # x ~ q = p
    num = np.arange(B_E) % (G_E + 1)
    keys = jax.random.split(jax.random.key(1), B_E)
    n, _ = _accept(tokens, _rows(p[:G_E]), _rows(p), num, keys)
    np.testing.assert_array_equal(n, num)


def test_first_rejected():
    uniform = np.full(V_E, 1 / V_E)
    p = np.stack([np.eye(V_E)[3], uniform, uniform, uniform])
    q = np.stack([np.eye(V_E)[1], uniform, uniform])
    n, nxt = _draws([1, 2, 0], q, p, G_E)
    assert np.all(n == 0) and np.all(nxt == 3)
    # soft case: p[0](x) = 0 forces n = 0; the token comes from the residual, never x
    p[0] = [0.0, 0.5, 0.3, 0.2, 0.0, 0.0]
    q[0] = [0.4, 0.5, 0.0, 0.0, 0.05, 0.05]
    n, nxt = _draws([0, 2, 0], q, p, G_E)
    assert np.all(n == 0)
    resid = np.maximum(p[0] - q[0], 0)  # [0, 0, .3, .2, 0, 0]
    assert _chi2_pvalue(np.bincount(nxt, minlength=V_E), resid / resid.sum()) > PASS_P


def test_num_proposed_zero_draws_from_first_p():
    p = _probs(12, temperature=1.0, top_p=0.9)
    n, nxt = _draws([p[0].argmax(), 0, 0], p[:G_E], p, 0)  # would pass if proposed
    assert np.all(n == 0)
    assert _chi2_pvalue(np.bincount(nxt, minlength=V_E), p[0]) > PASS_P


def test_padding_never_accepted():
    p = np.full((G_E + 1, V_E), 1 / V_E)
    q = np.zeros((G_E, V_E))
    q[:2] = 1 / V_E  # the padding row is all zero: u * 0 < p would pass it
    n, _ = _draws([1, 2, -1], q, p, 2)  # padding ids may be out of range
    assert np.all(n == 2)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_is_the_limit(seed):
    """One-hot p and q from logits_to_probs(T=0): accept iff draft == target argmax; the next
    token is the target argmax."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(2, B_E, G_E + 1, V_E)).astype(np.float32)  # target, draft
    match = rng.random((B_E, G_E + 1)) < 0.8  # drafts agree with the target most of the time
    logits[1] = np.where(match[..., None], logits[0], logits[1])
    num = rng.integers(0, G_E + 1, B_E)
    probs = np.asarray(_random_l2p(logits, SamplingParams.make(0.0)))
    p, q = probs[0], probs[1, :, :G_E]
    target, drafts = logits[0].argmax(-1), logits[1, :, :G_E].argmax(-1)
    np.testing.assert_array_equal(p, np.eye(V_E)[target])
    n, nxt = map(np.asarray, _accept(drafts, q, p, num, row_keys(jax.random.key(9), jnp.arange(B_E), 0)))
    for r in range(B_E):
        exp_n = 0
        while exp_n < num[r] and drafts[r, exp_n] == target[r, exp_n]:
            exp_n += 1
        assert (n[r], nxt[r]) == (exp_n, target[r, exp_n])
    assert 0 < (n == num).mean() < 1 and n.dtype == nxt.dtype == np.int32
    # a greedy program walks the same limit on the argmax tokens alone (no p, q or draw)
    parents = np.broadcast_to(np.arange(G_E) - 1, (B_E, G_E))
    path, gn, gnxt = accept_tree_greedy(drafts, parents, target, num, G_E + 1)
    np.testing.assert_array_equal(gn, n)
    np.testing.assert_array_equal(gnxt, nxt)
    kept = np.arange(G_E + 1)[None] <= n[:, None]
    np.testing.assert_array_equal(np.where(kept, path, 0), np.where(kept, np.arange(G_E + 1), 0))


_random_l2p = jax.jit(logits_to_probs)


def test_rows_are_independent_of_the_batch():
    """A row's (n, next) depends only on its own inputs and key: shuffling rows shuffles results."""
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(V_E), (B_E, G_E + 1)) * (rng.random((B_E, G_E + 1, V_E)) < 0.7)
    p[..., 0] += 1e-3  # no all-zero row
    p /= p.sum(-1, keepdims=True)
    q = rng.dirichlet(np.ones(V_E), (B_E, G_E))
    tokens = rng.integers(0, V_E, (B_E, G_E))
    num = rng.integers(0, G_E + 1, B_E)
    keys = row_keys(jax.random.key(2), jnp.arange(B_E), 7)
    n, nxt = map(np.asarray, _accept(tokens, q, p, num, keys))
    perm = rng.permutation(B_E)
    n2, nxt2 = map(np.asarray, _accept(tokens[perm], q[perm], p[perm], num[perm], keys[perm]))
    np.testing.assert_array_equal(n2, n[perm])
    np.testing.assert_array_equal(nxt2, nxt[perm])
    assert np.all((0 <= n) & (n <= num)) and 0 < n.mean() < G_E
    # and one row alone gives the same as inside the batch
    n_r, nxt_r = jax.jit(accept_row)(tokens[3], q[3], p[3], num[3], keys[3])
    assert (int(n_r), int(nxt_r)) == (n[3], nxt[3])
