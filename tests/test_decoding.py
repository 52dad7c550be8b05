"""pytest tests/test_decoding.py: greedy speculative decoding equals the baseline token for token.

Heads: (a) random (almost nothing accepted) and (b) oracles that propose the baseline's own
continuation (everything accepted; or the right token at rank 1-2, or wrong from depth 2: the accepted
lengths are then known exactly), each checking that the hidden states it reads are the baseline's own
(no drift in the pruned cache); tiny llama / mistral / qwen2 models; chain4, dense
and sparse64 trees; stop rules inside an accepted run; the context limit; the KV pruning.
Prompt lookup (models/engine/drafters/prompt_lookup.py): the n-gram index against a brute-force lookup, greedy
equality through the same decode step, its stop rules, lossless sampling with deterministic drafts.
"""
import pytest
import torch
import yaml
from torch import nn
from transformers import DynamicCache

from models.base import build_tiny_model
from models.engine.decoding import SamplingConfig, decode_step, generate, prefill, verify_tree
from models.shared import HeadsConfig
from models.methods import build_heads, method
from models.engine.kv_cache import MIN_CAPACITY, cache_kwargs, keep_accepted, new_cache
from models.engine.drafting import (DraftContext, NgramIndex, PromptLookupDrafter, TreeDrafter,
                                    cut_by_cost, heads_drafter)
from models.engine.trees import TreeBuffers, TreeSpec, chain_tree, tree_from_config
from tests.proposals import started
from pipelines.common import REPO_ROOT


def conf_tree(name):
    return tree_from_config(yaml.safe_load((REPO_ROOT / "conf" / "tree" / f"{name}.yaml").read_text()))


TREES = {"chain4": chain_tree(4), "dense": conf_tree("dense"), "sparse64": conf_tree("sparse64")}
FAMILIES = ("medusa", "hydra", "hydra_pp")


def prompt_ids(tok, text="Tell me a story about a cat."):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def perturbed(heads, seed: int = 0):
    """heads with every weight moved by 0.05 x N(0, 1) from a seeded generator, so each code path matters (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return heads


def random_heads(model, family, seed=0):
    """Freshly built heads with every weight perturbed, so each family's code path matters."""
    shared = family != "hydra"                            # both LM-head kinds: the base's (cpu profile) or own
    heads = build_heads(HeadsConfig.for_base(model, family, num_heads=4, share_lm_head=shared), model).eval()
    return perturbed(heads, seed)


class OracleHeads(nn.Module):
    """Proposes the baseline's own continuation: finds t by the nearest baseline hidden state.

    The snap must be exact: every hidden state the heads read (head_logits: the last accepted token's;
    read_hidden, Hydra++: every accepted position's) has to equal a baseline hidden state to float32
    rounding (SNAP_TOL, relative), at the position the decoder says it is (read_hidden's position_ids,
    Hydra's root = the baseline token after t). A decoder whose pruned KV cache drifts (wrong rows kept,
    stale rows, wrong position ids) fails here even where the nearest state would still give the right token.

    ranks[k]: the rank at which head k proposes the right token, the ranks above it wrong tokens; None: head k
    never proposes it (scored last). Default: rank 0 for every head. Other ranks are random tokens.
    Same interface as DraftHeads (config, method, family, head_logits, read_hidden).
    """

    SNAP_TOL = 1e-5     # measured: < 1e-6 on the tiny models (float32); pruned rows kept in fp16: 1e-5 - 1e-4

    def __init__(self, model, sequence: list[int], family: str, num_heads: int = 4, ranks=None):
        super().__init__()
        self.config = HeadsConfig(family=family, num_heads=num_heads, num_layers=1,
                                  hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                                  base_model="oracle")
        self.method = method(family)              # how it drafts: its family's proposer, as a DraftHeads
        self.family = self.method.family
        self.seq = torch.tensor(sequence)
        self.ranks = (0,) * num_heads if ranks is None else tuple(ranks)
        assert len(self.ranks) == num_heads
        with torch.inference_mode():
            self.H = model.get_decoder()(input_ids=self.seq[None]).last_hidden_state[0]   # [T, h]
        gaps = self._cdist(self.H, self.H).fill_diagonal_(float("inf"))
        assert gaps.min() > 1e3 * self.SNAP_TOL * self.H.norm(dim=-1).max(), "baseline hidden states too close to snap"
        self.calls, self.max_snap = 0, 0.0        # snaps checked; the largest relative distance seen

    @staticmethod
    def _cdist(a, b):
        # the exact difference, not |a|^2 + |b|^2 - 2ab (whose rounding, ~1e-3 here, would hide small drift)
        return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")

    def snap(self, flat: torch.Tensor, what: str) -> torch.Tensor:
        """flat [R, h] -> the baseline positions [R] they equal; fails unless each equals one (to SNAP_TOL)."""
        dist, t = self._cdist(flat, self.H).min(-1)
        rel = float((dist / flat.norm(dim=-1)).max())
        self.calls, self.max_snap = self.calls + 1, max(self.max_snap, rel)
        assert rel < self.SNAP_TOL, (f"{what}: a hidden state {rel:.2e} (relative) away from every baseline hidden "
                                     f"state (nearest: position {t.tolist()}): the decoder drifted from the baseline")
        return t

    def head_logits(self, k, hidden, path_tokens=None):
        flat = hidden.reshape(-1, hidden.shape[-1])
        t = self.snap(flat, f"head {k}")                                               # position of h_t
        if path_tokens is not None:            # Hydra: the path starts at the root, the baseline token after t
            assert (path_tokens.reshape(flat.shape[0], -1)[:, 0] == self.seq[t + 1]).all(), \
                f"head {k} reads h_t of position {t.tolist()}, not the root's parent"
        target = self.seq[(t + k + 2).clamp(max=len(self.seq) - 1)]
        logits = torch.randn(flat.shape[0], self.config.vocab_size, generator=torch.Generator().manual_seed(k))
        rows, rank, V = torch.arange(flat.shape[0]), self.ranks[k], self.config.vocab_size
        if rank is None:
            logits[rows, target] = -100.0                                              # never proposed
        else:
            logits[rows, target] = 100.0
            for i in range(rank):                                                      # wrong tokens above it
                logits[rows, (target + 1 + i) % V] = 100.0 + rank - i
        return logits.view(*hidden.shape[:-1], -1)

    def read_hidden(self, hidden, position_ids, cache=None):
        """Hydra++'s prefix layer, the identity here: every accepted position's hidden state is checked."""
        t = self.snap(hidden.reshape(-1, hidden.shape[-1]), "accepted positions")
        assert t.tolist() == position_ids.flatten().tolist(), \
            f"accepted hidden states of positions {t.tolist()} advanced as positions {position_ids.flatten().tolist()}"
        return hidden


def oracle_accept_lengths(depth: int, max_new_tokens: int) -> list[int]:
    """accept_lengths of a greedy run to max_new_tokens when every step accepts `depth` drafts (the draft is cut
    at the token limit): one bonus token per step."""
    lengths, n = [], 1                                   # the prefill token
    while n < max_new_tokens:
        lengths.append(min(depth, max_new_tokens - n - 1) + 1)
        n += lengths[-1]
    return lengths


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors run fastest on one thread


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny(request):
    model, tok = build_tiny_model(arch=request.param, seed=3)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    return model, tok, ids, base


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_random_heads_equal_baseline(tiny, family):
    model, tok, ids, base = tiny
    assert len(base.new_tokens) == 40 and base.accept_lengths == [1] * 39
    heads = random_heads(model, family)
    for name, tree in TREES.items():
        res = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=40, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens, f"{family} / {name} differs from the baseline"
        assert len(res.new_tokens) == 1 + sum(res.accept_lengths) and res.steps == len(res.accept_lengths)
        assert res.text == base.text


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_oracle_heads_equal_baseline(tiny, family):
    """A perfect oracle: every step accepts the whole depth of the tree (its rank-0 path), and the hidden states
    the heads read are the baseline's own (OracleHeads.snap, at every call)."""
    model, tok, ids, base = tiny
    heads = OracleHeads(model, ids + base.new_tokens, family)
    for name, tree in TREES.items():
        calls = heads.calls
        res = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=40, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens, f"oracle {family} / {name} differs from the baseline"
        assert res.accept_lengths == oracle_accept_lengths(tree.depth, 40), f"{name}: {res.accept_lengths}"
        assert sum(res.from_draft) == len(res.new_tokens) - 1 - res.steps   # drafts = all but prefill + bonuses
        assert heads.calls - calls >= res.steps                              # the heads ran (and snapped) each step
    assert heads.max_snap < OracleHeads.SNAP_TOL


# Oracles that make acceptance work: ranks[k] = the rank of the right token among head k's proposals (the
# ranks above it wrong tokens), None = never proposed. -> drafts accepted per step on each tree: the longest
# prefix of ranks that is a node of the tree (chain4: rank 0 only; dense: ranks 0-1, depth 3; sparse64: see
# conf/tree/sparse64.yaml, e.g. [1, 1], [2, 0, 0], [0, 2, 1] but not [1, 1, 1]).
RANKED_ORACLES = {       # the right token among its siblings: acceptance finds it at rank 1 or 2
    (1, 1, 1, 1): {"chain4": 0, "dense": 3, "sparse64": 2},
    (2, 0, 0, 0): {"chain4": 0, "dense": 0, "sparse64": 3},
    (0, 2, 1, 0): {"chain4": 1, "dense": 1, "sparse64": 3},
    (0, 1, 1, 0): {"chain4": 1, "dense": 3, "sparse64": 3},
}
WRONG_AT_DEPTH_2 = {     # right at depth 1, never at depth 2: one draft accepted, then a rejection; the deeper
    (0, None, 0, 0): {"chain4": 1, "dense": 1, "sparse64": 1},      # heads are right again, below a wrong parent
    (1, None, 0, 0): {"chain4": 0, "dense": 1, "sparse64": 1},
    (2, None, None, None): {"chain4": 0, "dense": 0, "sparse64": 1},
}


def check_oracle_variants(tiny, family, variants):
    model, tok, ids, base = tiny
    for ranks, depths in variants.items():
        heads = OracleHeads(model, ids + base.new_tokens, family, ranks=ranks)
        for name, tree in TREES.items():
            res = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=40, stop_token_ids=[])
            assert res.new_tokens == base.new_tokens, f"oracle {ranks} {family} / {name} differs from the baseline"
            assert res.accept_lengths == oracle_accept_lengths(depths[name], 40), \
                f"oracle {ranks} / {name}: accepted {res.accept_lengths}, want {depths[name]} drafts per step"
            assert sum(res.from_draft) == len(res.new_tokens) - 1 - res.steps
        assert heads.calls > 0 and heads.max_snap < OracleHeads.SNAP_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_oracle_right_token_at_rank_1_or_2(tiny, family):
    """The right token below one or two wrong siblings (trees with top_k > 1 at that depth): accepted there."""
    check_oracle_variants(tiny, family, RANKED_ORACLES)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_oracle_wrong_at_depth_2(tiny, family):
    """Right at depth 1 (rank 0, 1 or 2), wrong at depth 2: every step accepts one draft, rejects the next,
    and commits a pruned cache the next step must continue from exactly."""
    check_oracle_variants(tiny, family, WRONG_AT_DEPTH_2)


def test_stop_token_inside_accepted_run(tiny):
    model, tok, ids, base = tiny
    seq = base.new_tokens
    # the first token that appears once at index >= 6: it will sit inside an accepted chain of drafts
    stop = next(t for i, t in enumerate(seq) if i >= 6 and t not in seq[:i])
    ref = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[stop])
    assert ref.new_tokens == seq[: seq.index(stop) + 1] and ref.stop_reason == "eos"
    heads = OracleHeads(model, ids + seq, "hydra")
    for tree in TREES.values():
        res = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=40, stop_token_ids=[stop])
        assert res.new_tokens == ref.new_tokens and res.stop_reason == "eos"
        assert res.from_draft[-1], "the stop token should have been an accepted draft"


def test_max_new_tokens_inside_accepted_run(tiny):
    model, tok, ids, base = tiny
    heads = OracleHeads(model, ids + base.new_tokens, "medusa")
    for n in (1, 2, 7, 13):
        res = generate(model, tok, ids, heads_drafter(heads, TREES["sparse64"]), max_new_tokens=n, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens[:n] and res.stop_reason == "max_new_tokens"


def test_default_stop_is_tokenizer_eos():
    model, tok = build_tiny_model(arch="llama", seed=11)
    ids = prompt_ids(tok)
    free = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[]).new_tokens
    assert tok.eos_token_id in free                      # this seed emits <|im_end|> at token 21
    res = generate(model, tok, ids, max_new_tokens=40)
    assert res.new_tokens == free[: free.index(tok.eos_token_id) + 1] and res.stop_reason == "eos"
    heads = OracleHeads(model, ids + free, "hydra_pp")
    assert generate(model, tok, ids, heads_drafter(heads, TREES["sparse64"]), max_new_tokens=40).new_tokens == res.new_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_near_context_limit(arch):
    model, tok = build_tiny_model(arch=arch, max_position_embeddings=64, seed=5)
    ids = prompt_ids(tok, "x" * 38)                      # 59 tokens: room for 5 positions
    assert 55 < len(ids) < 64
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    assert base.stop_reason == "context_limit" and len(base.new_tokens) == 64 - len(ids) + 1
    heads = OracleHeads(model, ids + base.new_tokens, "medusa")
    for tree in TREES.values():
        res = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=40, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens and res.stop_reason == "context_limit"
    with pytest.raises(ValueError, match="context is 64"):
        generate(model, tok, list(range(3, 70)), max_new_tokens=4)


def test_tree_deeper_than_heads_fails_at_decode_time():
    model, tok = build_tiny_model(arch="llama", seed=3)
    heads = build_heads(HeadsConfig.for_base(model, "medusa", num_heads=2), model)
    with pytest.raises(ValueError, match=r"node \[0, 0, 0\] has depth 3"):
        generate(model, tok, [5, 6, 7], heads_drafter(heads, TREES["chain4"]), max_new_tokens=4)


@pytest.mark.parametrize("make_cache", [new_cache, DynamicCache])
def test_keep_accepted_equals_causal_forward(make_cache):
    """After pruning, the cache holds exactly the KV of prefix + accepted path, as a causal run would."""
    model, tok = build_tiny_model(arch="qwen2", seed=2)
    dec = model.get_decoder()
    prefix = torch.randint(3, 200, (1, 250))              # the growing cache passes its first capacity
    tree = TreeSpec("t", [[0], [1], [0, 0], [1, 0], [1, 1], [1, 1, 0]], top_k=2)
    buf = TreeBuffers.build(tree)
    tokens = torch.randint(3, 200, (buf.num_tokens,))
    with torch.inference_mode():
        cache = make_cache()
        dec(input_ids=prefix, use_cache=True, **cache_kwargs(dec, cache))
        hidden = verify_tree(dec, tokens, buf, cache, past=250)
        path = buf.retrieve[-1][buf.retrieve[-1] >= 0].tolist()          # root -> [1] -> [1,1] -> [1,1,0]
        assert path != list(range(len(path)))
        keep_accepted(cache, 250, [250], [path])
        ref_cache = DynamicCache()
        ref = dec(input_ids=torch.cat([prefix, tokens[path][None]], 1), use_cache=True, **cache_kwargs(dec, ref_cache))
    assert cache.get_seq_length() == 250 + len(path)
    for got, want in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden[path], ref.last_hidden_state[0, 250:], rtol=1e-4, atol=1e-5)
    cache.crop(-2)
    assert cache.get_seq_length() == 248 + len(path) and cache.layers[0].keys.shape[-2] == 248 + len(path)


def test_hydra_pp_prefix_state_is_incremental():
    """The drafter's Hydra++ state after start + advance equals the prefix layer run over everything."""
    model, tok = build_tiny_model(arch="llama", seed=4)
    heads = random_heads(model, "hydra_pp", seed=1)
    hidden = torch.randn(20, model.config.hidden_size)
    with torch.inference_mode():
        drafter = started(heads, hidden[:9])
        drafter.advance(hidden[9:10], [], 9)
        drafter.advance(hidden[10:20], [], 10)
        full = heads.read_hidden(hidden[None], torch.arange(20)[None])[0, -1]
    assert drafter.prefix_cache.get_seq_length() == 20
    torch.testing.assert_close(drafter.h, full, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(full, hidden[-1])          # the prefix layer is not the identity here


def test_typical_acceptance_runs_and_accepts_oracle():
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
    heads = OracleHeads(model, ids + base.new_tokens, "medusa")
    typical = SamplingConfig(temperature=0.01, acceptance="typical", seed=0)   # T -> 0: typical = greedy
    res = generate(model, tok, ids, heads_drafter(heads, TREES["sparse64"]), sampling=typical, max_new_tokens=24, stop_token_ids=[])
    assert res.new_tokens == base.new_tokens and res.mean_accepted_length > 3


@pytest.mark.slow
def test_smollm2_random_heads_equal_baseline(smollm_dir):  # smollm_dir builds the assets when missing
    from models.base import load_base_model

    model, tok = load_base_model(str(smollm_dir))
    ids = prompt_ids(tok, "Explain why the sky is blue in a short paragraph.")
    base = generate(model, tok, ids, max_new_tokens=32)
    for family in FAMILIES:
        heads = build_heads(HeadsConfig.for_base(model, family, 4, share_lm_head=True), model).eval()
        res = generate(model, tok, ids, heads_drafter(heads, TREES["sparse64"]), max_new_tokens=32)
        assert res.new_tokens == base.new_tokens, family


@pytest.mark.slow
def test_generate_cli(tmp_path, compose_cfg, capsys):
    """One run of the command itself (Hydra's command line, a calibrated tree read from a file), then the
    baseline and a chain through the same main() in this process (a subprocess costs its imports, ~15 s)."""
    import json
    import os
    import subprocess
    import sys

    from pipelines import generate as generate_cmd

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    tree_file = tmp_path / "optimal_tree.json"          # tree=optimal_pld reads the calibrated tree from a file
    tree_file.write_text(json.dumps({"name": "calibrated", "paths": [[0], [1], [0, 0]], "top_k": 10}))
    opts = ["random_heads=true", "prompt=Hello there", "max_new_tokens=12"]      # compose_cfg adds the tiny model
    out = tmp_path / "hydra.json"
    cmd = [sys.executable, "-m", "pipelines.generate", "model=tiny_random", *opts, "heads=hydra", "tree=optimal_pld",
           f"tree.file={tree_file}", "threads=1", f"output={out}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mean accepted length" in proc.stdout
    record = json.loads(out.read_text())
    assert len(record["new_tokens"]) == 12 and record["tree"] == "optimal_pld"
    for heads, tree in (("none", None), ("hydra_pp", "chain4")):
        out = tmp_path / f"{heads}.json"
        generate_cmd.main(compose_cfg(*opts, f"heads={heads}", "tree=chain4", f"output={out}"))
        assert "mean accepted length" in capsys.readouterr().out
        record = json.loads(out.read_text())
        assert len(record["new_tokens"]) == 12 and record["tree"] == tree


def test_generate_cli_refuses_a_negative_token_count(compose_cfg):
    """max_new_tokens=-3 fails naming the value, before any model is loaded, instead of an empty answer."""
    from pipelines import generate as generate_cmd

    with pytest.raises(ValueError, match=r"max_new_tokens=-3.*>= 1"):
        generate_cmd.main(compose_cfg("heads=none", "prompt=Hi", "max_new_tokens=-3",
                                      "model.source=/nonexistent/never-loaded"))
    model, tok = build_tiny_model()
    with pytest.raises(ValueError, match=r"max_new_tokens=-3"):
        generate(model, tok, [1, 2, 3], max_new_tokens=-3)


# -- prompt lookup through the same decode step ------------------------------------------------------
def lookup_reference(tokens, num_tokens, max_ngram, min_ngram=1):
    """Brute force: the most recent earlier occurrence of the longest suffix n-gram, copied on (overlapping)."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[L - n:]:
                seq = list(tokens)
                for j in range(num_tokens):
                    seq.append(seq[i + n + j])
                return seq[L:]
    return []


def test_ngram_index_on_hand_made_sequences():
    def lookup(tokens, num_tokens=4, max_ngram=3, min_ngram=1):
        index = NgramIndex(max_ngram)
        index.extend(tokens)
        return index.continuation(num_tokens, min_ngram)

    assert lookup([5, 6, 7, 5, 6]) == [7, 5, 6, 7]               # "5 6" at 0: then 7 5 6, copied on with period 3
    assert lookup([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1, 2, 8]      # the most recent "1 2" wins
    ctx = [3, 4, 1, 7, 2, 4, 1, 9, 3, 4, 1]
    assert lookup(ctx) == [7, 2, 4, 1]                           # longest first: "3 4 1" beats the later "4 1"
    assert lookup(ctx, max_ngram=2) == [9, 3, 4, 1]              # only up to 2-grams: the most recent "4 1"
    assert lookup([7, 7, 7], num_tokens=3) == [7, 7, 7]          # overlapping copy of a repeated token
    assert lookup([1, 2, 3, 4, 3]) == [4, 3, 4, 3] and lookup([1, 2, 3, 4, 3], min_ngram=2) == []
    assert lookup([1, 2, 3]) == [] and lookup([4]) == []         # the suffix itself is no match
    assert lookup([5, 6, 7, 5, 6], num_tokens=1) == [7]


def test_ngram_index_grows_like_the_brute_force_lookup():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        seq = torch.randint(0, 4, (60,), generator=g).tolist()   # small alphabet: many matches of every length
        index = NgramIndex(max_ngram=3)
        index.extend(seq[:5])
        for t in range(5, 60):
            index.extend([seq[t]])
            for min_ngram in (1, 2, 3):
                assert index.continuation(5, min_ngram) == lookup_reference(seq[:t + 1], 5, 3, min_ngram), (trial, t)


def test_prompt_lookup_drafter_chain_lengths():
    """The chain: up to num_tokens, tokens_per_ngram * n for an n-gram match, max_depth; none without a match."""
    def chain(prompt, root, max_depth=10, **settings):
        drafter = PromptLookupDrafter(**settings)
        drafter.start(DraftContext(torch.tensor(prompt), torch.zeros(len(prompt), 4), SamplingConfig()))
        draft = drafter.draft(root, max_depth)
        buf, tokens, draft_q = draft.buf, draft.tokens, draft.draft_q
        assert draft_q is None and buf.num_tokens == tokens.numel() and int(tokens[0]) == root
        assert buf.spec.paths == tuple((0,) * d for d in range(1, buf.num_tokens))     # a chain below the root
        return tokens[1:].tolist()

    three = [5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 1, 2]                       # root 3 completes the 3-gram "1 2 3"
    assert chain(three, 3, num_tokens=8) == [4, 6, 7, 8, 9, 10, 1, 2]
    assert chain(three, 3, num_tokens=8, tokens_per_ngram=2) == [4, 6, 7, 8, 9, 10]   # 2 x 3
    assert chain(three, 3, num_tokens=4, tokens_per_ngram=2) == [4, 6, 7, 8]
    assert chain(three, 3, max_depth=2, num_tokens=8) == [4, 6] and chain(three, 3, max_depth=0) == []
    assert chain([5, 7, 8, 9, 6], 7, num_tokens=8, tokens_per_ngram=2) == [8, 9]        # a 1-gram match: 2 x 1
    assert chain([5, 7, 8, 9, 6], 7, num_tokens=8, min_ngram=2) == []
    assert chain([5, 7, 8, 9, 6], 42) == []                                            # no match: a plain step

    drafter = PromptLookupDrafter(num_tokens=3, max_ngram=2)             # the accepted path joins the context
    drafter.start(DraftContext(torch.tensor([1, 2, 3]), torch.zeros(3, 4), SamplingConfig()))
    drafter.draft(9, 3)
    drafter.advance(torch.zeros(2, 4), [9, 8], position=3)
    assert drafter.index.tokens == [1, 2, 3, 9, 8]


def test_prompt_lookup_drafter_validates_its_settings():
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        PromptLookupDrafter(num_tokens=0)
    with pytest.raises(ValueError, match="min_ngram=3, max_ngram=2"):
        PromptLookupDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="tokens_per_ngram=0"):
        PromptLookupDrafter(tokens_per_ngram=0)


def cyclic_prompt(model, tok, text="x" * 200, known=40):
    """A chat prompt followed by the model's own first `known` greedy tokens: its greedy continuation is the
    rest of the same answer, which for these random models soon repeats, so lookups match."""
    ids = prompt_ids(tok, text)
    return ids + generate(model, tok, ids, max_new_tokens=known, stop_token_ids=[]).new_tokens


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_prompt_lookup_greedy_equals_baseline(arch):
    model, tok = build_tiny_model(arch=arch, seed=3)
    prompts = [prompt_ids(tok), prompt_ids(tok, "abc abc abc abc abc abc"), prompt_ids(tok, "x" * 200),
               cyclic_prompt(model, tok)]
    assert len(prompts[2]) < MIN_CAPACITY < len(prompts[2]) + 100     # the KV cache grows while decoding
    drafted = 0
    for ids in prompts:
        base = generate(model, tok, ids, max_new_tokens=100, stop_token_ids=[])
        for drafter in (PromptLookupDrafter(num_tokens=4, max_ngram=3), PromptLookupDrafter(num_tokens=10, max_ngram=1),
                        PromptLookupDrafter(num_tokens=8, max_ngram=3, tokens_per_ngram=3)):
            res = generate(model, tok, ids, drafter, max_new_tokens=100, stop_token_ids=[])
            assert res.new_tokens == base.new_tokens and res.text == base.text
            assert len(res.new_tokens) == 1 + sum(res.accept_lengths) and res.steps == len(res.accept_lengths)
            assert sum(res.from_draft) == len(res.new_tokens) - 1 - res.steps     # drafts = all but prefill + bonuses
            drafted += sum(res.from_draft)
            assert max(res.accept_lengths) <= drafter.num_tokens + 1
            if ids is prompts[-1]:                                     # a repeating answer: fewer steps
                assert res.steps < base.steps
    assert drafted > 20


def test_prompt_lookup_stop_rules():
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = cyclic_prompt(model, tok, known=4)
    base = generate(model, tok, ids, max_new_tokens=60, stop_token_ids=[])
    free = generate(model, tok, ids, PromptLookupDrafter(4, 3), max_new_tokens=60, stop_token_ids=[])
    seq = free.new_tokens
    # a token first emitted as an accepted draft (copied from the prompt): a stop token inside an accepted run
    first_drafted = [i for i, t in enumerate(seq) if free.from_draft[i] and t not in seq[:i]]
    assert first_drafted, "this setup no longer drafts a new token from the prompt"
    stop = seq[first_drafted[0]]
    ref = generate(model, tok, ids, max_new_tokens=60, stop_token_ids=[stop])
    res = generate(model, tok, ids, PromptLookupDrafter(4, 3), max_new_tokens=60, stop_token_ids=[stop])
    assert res.new_tokens == ref.new_tokens == seq[:first_drafted[0] + 1] and res.stop_reason == "eos"
    assert res.from_draft[-1]
    for n in (1, 2, 7, 13):                                        # the token limit cuts the chains
        res = generate(model, tok, ids, PromptLookupDrafter(4, 3), max_new_tokens=n, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens[:n] and res.stop_reason == "max_new_tokens"


def test_prompt_lookup_near_context_limit():
    model, tok = build_tiny_model(arch="qwen2", max_position_embeddings=64, seed=5)
    ids = prompt_ids(tok, "x" * 38)                                # 59 tokens: room for 5 positions
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    res = generate(model, tok, ids, PromptLookupDrafter(4, 3), max_new_tokens=40, stop_token_ids=[])
    assert res.new_tokens == base.new_tokens and res.stop_reason == base.stop_reason == "context_limit"


def test_prompt_lookup_sampling_is_lossless():
    """Deterministic drafts (q = a point mass) under lossless speculative sampling: the first three tokens
    follow the model's own top-k distribution (computed exactly), while many drafts are accepted."""
    from collections import Counter

    from scipy.stats import chisquare

    model, tok = build_tiny_model(arch="llama", seed=3)
    ids, T, K, n = cyclic_prompt(model, tok), 0.7, 3, 300
    with torch.inference_mode():
        def top(prefix):                                           # [(token, p)] under top-k and temperature
            vals, idx = torch.topk(model(torch.tensor([prefix])).logits[0, -1], K)
            return list(zip(idx.tolist(), (vals / T).softmax(-1).tolist()))
        expected = {(a, b, c): pa * pb * pc for a, pa in top(ids) for b, pb in top(ids + [a])
                    for c, pc in top(ids + [a, b])}
    counts, drafted = Counter(), 0
    for seed in range(n):
        sampling = SamplingConfig(temperature=T, top_k=K, acceptance="sampling", seed=seed)
        res = generate(model, tok, ids, PromptLookupDrafter(4, 3), sampling=sampling, max_new_tokens=3, stop_token_ids=[])
        counts[tuple(res.new_tokens)] += 1
        drafted += sum(res.from_draft)
    assert drafted > 0.3 * n
    big = [k for k, p in expected.items() if p * n >= 5]
    obs = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    exp = [expected[k] * n for k in big] + [n * (1 - sum(expected[k] for k in big))]
    assert chisquare(obs, [e * n / sum(exp) for e in exp]).pvalue > 0.01


def test_decode_step_drives_a_loop_by_hand():
    """prefill + decode_step: the same tokens and cache length as generate (the loop other callers time)."""
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = cyclic_prompt(model, tok)
    want = generate(model, tok, ids, PromptLookupDrafter(4, 3), max_new_tokens=30, stop_token_ids=[])
    drafter = PromptLookupDrafter(4, 3)
    with torch.inference_mode():
        state = prefill(model, torch.tensor([ids]), SamplingConfig(), drafter=drafter)
        got, lengths = [state.root], []
        while len(got) < 30:
            tokens, drafted = decode_step(state, drafter, max_depth=30 - len(got) - 1)
            assert tokens[-1] == state.root and len(tokens) == drafted + 1
            got += tokens
            lengths.append(len(tokens))
            assert state.cache.get_seq_length() == state.past == len(ids) + len(got) - 1
    assert got == want.new_tokens and lengths == want.accept_lengths
    assert set(state.timings) == {"draft", "verify", "lm_head", "accept", "commit"} and state.timings["verify"] > 0
    assert 0 < state.timings["lm_head"] < state.timings["verify"]


@pytest.mark.parametrize("family", ["medusa", "hydra_pp"])
def test_time_step_rewinds_state_and_drafter(family):
    """time_step (calibration's and the latency profile's timer) takes real steps and rewinds them: decoding
    after it emits what it would have emitted without it, and each repeat took the same step."""
    from models.engine.decoding import time_step
    from models.engine.trees import tree_from_config

    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = cyclic_prompt(model, tok)
    heads = build_heads(HeadsConfig.for_base(model, family, 3, 1), model).eval()
    tree = tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [0, 0], [0, 0, 0]]})
    want = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=12, stop_token_ids=[])
    with torch.inference_mode():
        drafter = TreeDrafter(heads, tree)
        state = prefill(model, torch.tensor([ids]), SamplingConfig(), drafter=drafter)
        got = [state.root]
        tokens, _ = decode_step(state, drafter, max_depth=3)
        got += tokens
        past, root, length = state.past, state.root, state.cache.get_seq_length()
        parts = time_step(state, drafter, max_depth=3, repeats=3)
        assert len(parts) == 3 and all(p["step"] > 0 and p["verify"] >= p["lm_head"] > 0 for p in parts)
        assert (state.past, state.root, state.cache.get_seq_length()) == (past, root, length)
        while len(got) < 12:
            tokens, _ = decode_step(state, drafter, max_depth=min(3, 12 - len(got) - 1))
            got += tokens
    assert got[:12] == want.new_tokens


# -- trees cut per step by cost (conf/tree/cut.yaml) ----------------------------------------------


def test_cut_by_cost_keeps_the_nodes_that_pay_for_themselves():

    probs = [1.0, 0.6, 0.1, 0.5, 0.05]           # node 3 is node 1's child (0.6 * 0.83), nodes 2 and 4 are weak
    flat = [1.0, 1.0, 1.0, 1.0, 1.0]
    assert cut_by_cost(probs, flat) == (0, 1, 2, 3, 4)                    # free tokens: keep everything
    assert cut_by_cost(probs, [1.0, 100.0, 100.0, 100.0, 100.0]) == (0,)  # dear tokens: a plain step
    # (1 + .6) / 1.1 = 1.45, (1 + .6 + .5) / 1.2 = 1.75, (2.1 + .1) / 1.5 = 1.47: the two likely nodes
    assert cut_by_cost(probs, [1.0, 1.1, 1.2, 1.5, 1.6]) == (0, 1, 3)
    assert cut_by_cost([1.0, 0.3, 0.3], [1.0, 1.2, 1.2]) == (0, 1, 2)        # ties: the parent first
    assert cut_by_cost([1.0, 0.9, 0.9], [1.0, 1.0]) == (0, 1)                # no cost known for 3 tokens


def test_subtree_buffers_keep_the_node_order():
    spec = TreeSpec("t", ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)), top_k=2)
    buf = TreeBuffers.build(spec)
    sub = buf.subtree((0, 1, 3, 6))                # root, (0,), (0, 0), (0, 0, 0)
    assert sub.spec.paths == ((0,), (0, 0), (0, 0, 0)) and sub.num_tokens == 4
    assert sub.parent.tolist() == [-1, 0, 1, 2] and buf.subtree((0, 1, 3, 6)) is sub


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp"])
def test_a_tree_cut_by_cost_stays_lossless(family):
    """Greedy output equals the baseline whatever the cut keeps: everything, nothing (plain steps) or a
    confidence-dependent part of the tree."""
    model, tok = build_tiny_model(arch="llama", seed=3)
    ids = cyclic_prompt(model, tok)
    heads = random_heads(model, family)
    tree = TreeSpec("t", ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)), top_k=2)
    want = generate(model, tok, ids, max_new_tokens=30, stop_token_ids=[])
    whole = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=30, stop_token_ids=[])
    free = generate(model, tok, ids, heads_drafter(heads, tree, step_cost=[1.0] * 7), max_new_tokens=30, stop_token_ids=[])
    dear = generate(model, tok, ids, heads_drafter(heads, tree, step_cost=[1.0] + [50.0] * 6), max_new_tokens=30, stop_token_ids=[])
    some = generate(model, tok, ids, heads_drafter(heads, tree, step_cost=[1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.5]), max_new_tokens=30, stop_token_ids=[])
    for res in (whole, free, dear, some):
        assert res.new_tokens == want.new_tokens
    assert free.accept_lengths == whole.accept_lengths
    assert dear.accept_lengths == [1] * 29 and dear.timings["draft"] > 0      # drafted, then cut to the root


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_reference_is_the_models_own_generate_past_the_first_cache_capacity(arch):
    """Our baseline loop shares its cache and projection code with the speculative one, so it is checked against
    transformers' own generate(do_sample=False) too, on a prompt that makes the KV cache outgrow its first
    capacity (MIN_CAPACITY rows) while decoding."""
    model, tok = build_tiny_model(arch=arch, seed=5, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (MIN_CAPACITY - 20,), generator=g).tolist()
    new = 60                                          # the cache grows from 236 to 296 rows: past 256
    hf = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                        pad_token_id=tok.pad_token_id, temperature=None, top_p=None, top_k=None)[0, len(ids):].tolist()
    ours = generate(model, tok, ids, max_new_tokens=new, stop_token_ids=[])
    assert ours.new_tokens == hf
    for family in ("medusa", "hydra_pp"):
        spec = generate(model, tok, ids, heads_drafter(random_heads(model, family), TreeSpec("t", ((0,), (1,), (0, 0), (0, 0, 0)), top_k=2)), max_new_tokens=new, stop_token_ids=[])
        assert spec.new_tokens == hf
