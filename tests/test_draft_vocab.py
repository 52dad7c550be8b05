"""pytest tests/test_draft_vocab.py: the frequency-ranked draft vocabulary and the heads, drafter and decoder on it.

Ranking and ties, coverage, null = the full vocabulary; heads save and load with their vocabulary and refuse
one that does not fit the base model; drafts only ever hold draft-vocabulary tokens; greedy speculative
decoding with a small draft vocabulary equals the baseline; sampled drafts come with a q over the full
vocabulary that is zero outside the draft vocabulary.
"""
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.engine.drafting import heads_drafter
from tests.proposals import propose, started
from models.engine.acceptance import SamplingConfig, warp_probs
from models.base import build_tiny_model
from models.engine.decoding import generate
from models.shared.draft_vocab import answer_token_counts, check_draft_ids, coverage, most_frequent
from models.shared import HeadsConfig
from models.methods import build_heads, load_heads
from models.engine.trees import TreeBuffers, chain_tree, dense_tree, tree_from_config
from pipelines.common import REPO_ROOT
from tests.test_decoding import perturbed

FAMILIES = ("medusa", "hydra", "hydra_pp")


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors run fastest on one thread


# -- the vocabulary ---------------------------------------------------------------------------------


def test_most_frequent_ranks_by_count_then_by_id():
    labels = [[-100, 1, 2, 2, 4], [-100, -100, 1, 2, 0, 4, 5, 1]]       # counts: 0:1 1:3 2:3 4:2 5:1
    counts = answer_token_counts(labels, vocab_size=7)
    assert counts.tolist() == [1, 3, 3, 0, 2, 1, 0]
    assert most_frequent(counts, 4).tolist() == [1, 2, 4, 0]            # 1 and 2 tie: lower id first; then 0 before 5
    assert most_frequent(counts, 7).tolist() == [1, 2, 4, 0, 5, 3, 6]   # unseen tokens last, by id
    with pytest.raises(ValueError, match="between 1 and the vocabulary size 7"):
        most_frequent(counts, 8)
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        answer_token_counts([[9]], vocab_size=7)


def test_coverage_counts_answer_tokens_and_null_is_the_full_vocabulary():
    val = [[-100, 1, 1, 3], [2, -100, 6]]                                # answer tokens 1 1 3 2 6
    assert coverage(torch.tensor([1, 2]), val) == pytest.approx(3 / 5)
    assert coverage(torch.tensor([5]), val) == 0.0
    assert coverage(None, val) == 1.0


def test_draft_ids_must_fit_the_model():
    check_draft_ids(torch.tensor([3, 0, 9]), vocab_size=10, size=3)
    with pytest.raises(ValueError, match="vocab_size=10"):
        check_draft_ids(torch.tensor([3, 10]), vocab_size=10, size=2)
    with pytest.raises(ValueError, match="twice"):
        check_draft_ids(torch.tensor([3, 3]), vocab_size=10, size=2)
    with pytest.raises(ValueError, match="must be 3 integer token ids"):
        check_draft_ids(torch.tensor([3, 4]), vocab_size=10, size=3)


# -- heads on a draft vocabulary ----------------------------------------------------------------------


def draft_heads(model, family, draft_ids, share=True, seed=0):
    config = HeadsConfig.for_base(model, family, num_heads=4, num_layers=2 if family == "hydra_pp" else 1,
                                  share_lm_head=share, draft_vocab_size=len(draft_ids))
    heads = build_heads(config, model, draft_ids).eval()
    return perturbed(heads, seed)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("share", [True, False])
def test_heads_save_and_load_with_their_draft_vocabulary(tmp_path, family, share):
    model, _ = build_tiny_model(seed=0)
    ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(1))[:24]
    heads = draft_heads(model, family, ids, share)
    heads.save(tmp_path / "h")
    saved = load_file(str(tmp_path / "h" / "heads.safetensors"))
    assert torch.equal(saved["draft_ids"], ids)
    assert not any(k.startswith("base_rows") for k in saved)          # the shared rows are rebuilt, never saved
    _, loaded = load_heads(tmp_path / "h", model)
    assert loaded.config.draft_vocab_size == 24 and torch.equal(loaded.draft_ids, ids)
    h, path = torch.randn(3, model.config.hidden_size), torch.randint(0, 200, (3, 2))
    with torch.no_grad():
        a = heads.head_logits(1, h, path if family != "medusa" else None)         # [3, V]
        b = loaded.head_logits(1, h, path if family != "medusa" else None)
        draft = heads.draft_logits(1, h, path if family != "medusa" else None)    # [3, 24]
    assert torch.equal(a, b) and draft.shape == (3, 24)
    assert torch.equal(a[:, ids], draft)
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(a[:, outside]).all()
    if share:   # the shared LM head is the base LM head's rows for the draft ids
        x = heads.head_hidden(1, h, path if family != "medusa" else None)
        assert torch.allclose(draft, model.get_output_embeddings()(x)[:, ids], atol=1e-5)


def test_a_draft_vocabulary_outside_the_base_vocabulary_is_refused(tmp_path):
    model, _ = build_tiny_model(seed=0)
    V = model.config.vocab_size
    draft_heads(model, "hydra", torch.arange(8)).save(tmp_path / "h")
    state = load_file(str(tmp_path / "h" / "heads.safetensors"))
    state["draft_ids"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, V])
    save_file(state, str(tmp_path / "h" / "heads.safetensors"))
    with pytest.raises(ValueError, match=f"token ids in \\[0, {V}\\].*vocab_size={V}"):
        load_heads(tmp_path / "h", model)


# -- drafting and decoding ---------------------------------------------------------------------------


def prompt_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def sparse64():
    import yaml

    return tree_from_config(yaml.safe_load((REPO_ROOT / "conf" / "tree" / "sparse64.yaml").read_text()))


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_hold_only_draft_vocabulary_tokens(family):
    model, _ = build_tiny_model(seed=2)
    ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(2))[:12]
    heads = draft_heads(model, family, ids, share=family != "hydra")
    buf = TreeBuffers.build(sparse64())                                   # up to 10 ranks per node
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, acceptance="sampling", seed=0)):
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            drafter = started(heads, torch.randn(6, model.config.hidden_size), sampling, gen)
            tokens, _, _ = propose(drafter, 5, buf, sampling, gen)
        assert torch.isin(tokens[1:], ids).all()
    drafter = started(draft_heads(model, family, ids[:4]), torch.randn(6, model.config.hidden_size))
    with pytest.raises(ValueError, match="ranks per node but the draft scores only 4 tokens"):
        propose(drafter, 5, buf)


def fit_heads(model, heads, seq, start, steps=30, lr=3e-2):
    """Overfit the heads (over their draft vocabulary) to the base's greedy tokens of one sequence."""
    ids = torch.tensor(seq)
    with torch.no_grad():
        h = model.get_decoder()(input_ids=ids[None]).last_hidden_state
        greedy = model.get_output_embeddings()(h)[0].argmax(-1)                      # [T]: g_{s+1}
    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=lr)
    heads.train()
    for _ in range(steps):
        hid, loss = heads.read_hidden(h, torch.arange(len(seq))[None])[0], 0.0
        for d in range(1, heads.config.num_heads + 1):
            t = torch.arange(start, len(seq) - d)
            index = heads.to_draft_index(greedy[t + d])
            keep = index >= 0
            path = ids[t[:, None] + 1 + torch.arange(d)]
            logits = heads.draft_logits(d - 1, hid[t], path)
            loss = loss + torch.nn.functional.cross_entropy(logits[keep], index[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_with_a_small_draft_vocabulary_equals_the_baseline(family):
    """Heads fitted to the baseline's answer over a draft vocabulary that lacks some of its tokens: many drafts
    are accepted, the tokens outside the vocabulary come from the base model, and the output is the baseline's."""
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=3)
    model.requires_grad_(False)
    prompt = prompt_ids(tok, "Tell me a story about a cat.")
    base = generate(model, tok, prompt, max_new_tokens=40, stop_token_ids=[])
    answer = torch.tensor(base.new_tokens)
    counts = answer_token_counts([base.new_tokens], model.config.vocab_size)
    distinct = int((counts > 0).sum())
    ids = most_frequent(counts, max(10, distinct - 3))        # leaves out some answer tokens (and adds unseen ones)
    assert not torch.isin(answer, ids).all()
    heads = fit_heads(model, draft_heads(model, family, ids, share=family != "hydra"), prompt + base.new_tokens,
                      len(prompt) - 1)
    accepted = 0
    for tree in (chain_tree(4), dense_tree(2, 3), sparse64()):
        res = generate(model, tok, prompt, heads_drafter(heads, tree), max_new_tokens=40, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens, f"{family}: {res.new_tokens} != {base.new_tokens}"
        drafted = [t for t, d in zip(res.new_tokens, res.from_draft) if d]
        assert torch.isin(torch.tensor(drafted, dtype=torch.long), ids).all()
        accepted += len(drafted)
    assert accepted > 20, f"only {accepted} drafts accepted: the test would not test much"


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_sampled_drafts_q_is_a_full_vocabulary_distribution_zero_outside(family):
    model, _ = build_tiny_model(arch="qwen2", seed=1)
    V = model.config.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:20]
    heads = draft_heads(model, family, ids, share=family == "medusa")
    sampling = SamplingConfig(temperature=0.8, top_k=15, acceptance="sampling", draft="sample", seed=0)
    buf = TreeBuffers.build(dense_tree(3, 2))
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        drafter = started(heads, torch.randn(5, model.config.hidden_size), sampling, gen)
        tokens, draft_q, _ = propose(drafter, 7, buf, sampling, gen)
        for node in buf.parent_list:
            q = draft_q(node)
            assert q.shape == (V,) and float(q.sum()) == pytest.approx(1.0, abs=1e-5)
            assert (q[outside] == 0).all() and (q[ids] > 0).sum() == 15            # top_k 15 of the 20
            d = int(buf.depth[node])
            path = tokens[buf.retrieve[(buf.retrieve == node).any(1)][0, :d + 1]][None]
            want = warp_probs(heads.head_logits(d, drafter.h[None], path if family == "hydra" else None)[0], sampling)
            torch.testing.assert_close(q, want, rtol=1e-4, atol=1e-6)
            assert bool((q[tokens[buf.children[node]]] > 0).all())
