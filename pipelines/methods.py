"""Which methods an evaluation runs, and the drafter each decodes with (used by evaluate, generate and the benches).

    sel = selection(cfg)                       # heads: one family x profile.eval.trees; references: the prompt
                                               # lookups; selected: heads x tree; all: families x trees
    methods = build_methods(cfg, model, sel)   # baseline, <heads>-<tree>, <draft model>_hf, baseline-<adapted heads>,
                                               # and pld, pld_hf, hf_generate, eval.drafters where sel.peers
    drafter = drafter_for(method, cfg)         # a fresh drafter for one answer (None: the baseline)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from models.engine.drafting import StepDrafter, make_drafter, tree_drafter
from models.engine.fast_inference import prepare_heads_for_decoding
from models.engine.path_choice import prepare_for_decoding, stock_copy
from models.engine.trees import GrownTree, TreeOption, TreeSpec, tree_option
from models.shared import HeadsConfig
from models.methods import build_heads
from models.measure.mtbench import spread
from models.measure.latency import relative_step_costs
from models.methods import load_for_decoding
from pipelines.common import conf_option, log

METHOD_MODES = ("auto", "all", "selected", "heads", "references")
SWEEP_MODES = ("heads", "all")     # runs over profile.eval.trees, where profile.eval.tree_questions applies


class Kind(str, Enum):
    """What a contender runs: our loops (baseline: no drafter; reference: the base of an adapted backbone, no drafter;
    heads: draft heads on a tree; pld: our prompt lookup; drafter: any make_drafter spec) and transformers' own
    (pld_hf: its prompt lookup; sps_hf: its assisted generation; hf_generate: its greedy generate). A str, so that
    the records and the analysis read the plain name."""
    BASELINE = "baseline"
    REFERENCE = "reference"
    HEADS = "heads"
    PLD = "pld"
    DRAFTER = "drafter"
    PLD_HF = "pld_hf"
    SPS_HF = "sps_hf"
    HF_GENERATE = "hf_generate"

    @property
    def prompt_lookup(self) -> bool:
        return self in (Kind.PLD, Kind.PLD_HF)

    @property
    def greedy_reference(self) -> bool:
        """Its greedy answers are the ones the others must reproduce (the base's, or an adapted backbone's)."""
        return self in (Kind.BASELINE, Kind.REFERENCE)


@dataclass
class Contender:
    """One entry of the evaluation, a decoding loop timed against the baseline on every question it runs (named
    apart from models.shared.method.Method, a drafting method, which a heads contender carries)."""
    name: str
    kind: Kind                     # a Kind or its name
    model: object
    heads: object = None
    option: TreeOption | None = None   # kind heads: its tree option (the tree, its per-step cut, a lookup branch)
    heads_name: str | None = None
    family: str | None = None
    reference: str | None = None   # the method whose greedy tokens this one must reproduce
    tree_name: str | None = None   # the conf/tree option (profile.eval.tree_questions is keyed by it)
    spec: dict | None = None       # kind drafter: its drafter spec (make_drafter)
    assistant: object = None       # kind sps_hf: the draft model as a transformers model (assisted generation)

    def __post_init__(self):
        if self.kind not in set(Kind):
            raise ValueError(f"contender {self.name!r}: kind {self.kind!r} is not one of {[k.value for k in Kind]}")
        self.kind = Kind(self.kind)

    @property
    def tree(self) -> TreeSpec | GrownTree | None:
        return None if self.option is None else self.option.tree

    @property
    def step_cost(self) -> list[float] | None:
        """The relative step costs its tree is cut with per step (conf/tree/cut.yaml cut_by_cost), else None."""
        costs = None if self.option is None else self.option.step_cost
        return None if costs is None else list(costs)

    @property
    def lookup(self) -> bool:
        """Whether prompt lookup's chain joins its tree (conf/tree/optimal_pld.yaml)."""
        return self.option is not None and self.option.lookup

    def describe(self) -> dict:
        return {"kind": self.kind.value, "heads": self.heads_name, "family": self.family,
                "tree": self.tree.name if self.tree else None, "tree_nodes": self.tree.num_nodes if self.tree else None,
                "reference": self.reference, "cut_by_cost": self.step_cost is not None, "lookup_branch": self.lookup,
                **({"drafter": self.spec} if self.spec else {}),
                **({"grown": {"depth": self.tree.depth, "top_k": self.tree.top_k, "nodes": self.tree.nodes}}
                   if isinstance(self.tree, GrownTree) else {})}


# -- 1) which methods ----------------------------------------------------------------------------
@dataclass
class Selection:
    mode: str                      # all | selected
    tag: str                       # results/eval/<tag>/
    metrics_name: str              # reports/metrics/<metrics_name>.json
    heads: list[str]               # heads names (results/heads/<name>)
    trees: list[str | None]        # tree names; None = this config's own tree
    peers: bool = True             # both prompt lookups, transformers' greedy generate and eval.drafters run too


def selection(cfg: DictConfig) -> Selection:
    """What to run: eval.methods = heads | references | all | selected, or auto (conf/eval/mtbench.yaml's eval.tag
    rule)."""
    methods = cfg.eval.methods
    if methods not in METHOD_MODES:
        raise ValueError(f"eval.methods={methods!r} is not known; use one of {list(METHOD_MODES)}")
    mode = methods if methods != "auto" else ("all" if cfg.eval.tag == "all" else "selected")
    if mode == "references":
        return Selection("references", "references", "references", [], [])
    if mode == "heads":
        name = cfg.heads.name
        if cfg.heads.get("family") == "none":
            raise ValueError(f"eval.methods=heads needs trained heads, not heads={name!r}; use eval.methods=references")
        return Selection("heads", name, f"evaluate_{name}", [name], list(cfg.profile.eval.trees), peers=False)
    if mode == "all":
        return Selection("all", "all", "evaluate", list(cfg.profile.eval.families), list(cfg.profile.eval.trees))
    tag = f"{cfg.heads.name}-{cfg.tree.name}"
    heads = [] if cfg.heads.get("family") == "none" else [cfg.heads.name]
    also = [str(t) for t in cfg.eval.get("selected_trees") or [] if str(t) != cfg.tree.name]
    return Selection("selected", tag, f"evaluate_{tag}", heads, [None, *dict.fromkeys(also)])


def family_trees(cfg: DictConfig, sel: Selection, heads_name: str) -> list[str]:
    """The trees one family runs beside profile.eval.trees in a tree sweep (profile.eval.family_trees: DSpark's tree
    cut per step by its confidence head, and the same tree uncut), [] for any other selection or family."""
    if sel.mode not in SWEEP_MODES:
        return []
    extra = OmegaConf.select(cfg, f"profile.eval.family_trees.{heads_name}", default=None) or []
    if isinstance(extra, str) or not all(isinstance(t, str) for t in extra):
        raise ValueError(f"profile.eval.family_trees.{heads_name}={extra!r}: use a list of conf/tree option names")
    return [str(t) for t in extra if str(t) not in sel.trees]


def tree_config(cfg: DictConfig, tree_name: str | None, heads_name: str) -> dict:
    """This config's tree, or conf/tree/<name>.yaml resolved for heads_name (tree=optimal is per heads)."""
    if tree_name is None:
        return OmegaConf.to_container(cfg.tree, resolve=True)
    try:
        tree = conf_option("tree", tree_name)
    except ValueError as err:
        raise ValueError(f"profile.eval.trees names {tree_name!r}: {err}") from None
    node = OmegaConf.merge({"paths": cfg.paths, "heads": {"name": heads_name}}, {"tree": tree})
    return OmegaConf.to_container(node, resolve=True)["tree"]


def step_cost_for(option: TreeOption, extra_tokens: int = 0) -> list[float] | None:
    """The relative step costs a `cut_by_cost` tree is cut with (from that latency profile), else None; for steps
    of up to the tree's tokens + extra_tokens (a lookup branch's)."""
    if not option.cut_by_cost:
        return None
    path = Path(option.cut_by_cost)
    if not path.is_file():
        raise FileNotFoundError(f"tree {option.tree.name!r}: cut_by_cost={str(path)!r} does not exist; it is written "
                                "by `python -m pipelines.calibrate +task=latency` (dvc stage calibrate_latency)")
    prof = json.loads(path.read_text())
    return relative_step_costs(prof["sizes"], prof["forward_lm_head_s"], prof["baseline_step_s"],
                               option.tree.num_nodes + 1 + extra_tokens)


def pld_settings(cfg: DictConfig) -> dict:
    """Our prompt lookup's settings (eval.prompt_lookup.pld): method `pld`, and the branch of a lookup tree."""
    pld = cfg.eval.prompt_lookup.pld
    return {"num_tokens": int(pld.num_tokens), "max_ngram": int(pld.max_ngram), "min_ngram": int(pld.min_ngram),
            "tokens_per_ngram": None if pld.tokens_per_ngram is None else int(pld.tokens_per_ngram)}


def heads_spec(cfg: DictConfig, option: TreeOption) -> dict:
    """The drafter spec (make_drafter) of draft heads on a tree option: its tree, cut per step by its step costs where
    it has them, with prompt lookup's chain merged in (eval.prompt_lookup.pld) where it says `lookup`; the one place
    the evaluation, the batch curve, the generate command and the load bench build it."""
    spec = {"kind": "heads", "tree": option.tree, "step_cost": None if option.step_cost is None else
            list(option.step_cost)}
    return {**spec, "kind": "heads_lookup", "lookup": pld_settings(cfg)} if option.lookup else spec


def drafter_for(method: "Contender", cfg: DictConfig) -> StepDrafter | None:
    """A fresh drafter for one answer of `method` (drafters keep per-answer state); None: the baseline."""
    if method.kind is Kind.PLD:
        return make_drafter({"kind": "prompt_lookup", **pld_settings(cfg)})
    if method.kind is Kind.DRAFTER:
        return make_drafter(method.spec)
    if method.kind is not Kind.HEADS:
        return None
    return make_drafter(heads_spec(cfg, method.option), heads=method.heads)


def resolve_tree(cfg: DictConfig, tree_cfg: dict, name: str) -> TreeOption:
    """A resolved conf/tree option (tree_config) parsed, with the step costs of its cut where it is cut per step
    (with_costs). A tree cut per step or grown by a lookup branch is named by the option: the file it reads (the
    calibrated tree of optimal or cut) is only where it starts."""
    return with_costs(cfg, tree_option(tree_cfg, name))


def with_costs(cfg: DictConfig, option: TreeOption) -> TreeOption:
    """The option with the relative step costs of its cut_by_cost profile (None: not cut), for steps of its tree
    and, where prompt lookup joins it, the lookup branch's tokens (eval.prompt_lookup.pld.num_tokens)."""
    extra = int(cfg.eval.prompt_lookup.pld.num_tokens) if option.lookup else 0
    return option.with_step_cost(step_cost_for(option, extra))


def build_methods(cfg: DictConfig, model, sel: Selection) -> list[Contender]:
    methods = [Contender("baseline", Kind.BASELINE, model)]
    for name in sel.heads:
        folder = Path(cfg.paths.results) / "heads" / name
        # a LoRA adapter is merged into a copy of the backbone, which gets its own AR reference
        base, heads, adapted = load_for_decoding(folder, model, keep_base=True)
        reference = f"baseline-{name}" if adapted else "baseline"
        if adapted:
            methods.append(Contender(reference, Kind.REFERENCE, base, heads_name=name, family=heads.config.family,
                                  reference=None))
        for tree_name in [*sel.trees, *family_trees(cfg, sel, name)]:
            option_name = tree_name or cfg.tree.name
            option = resolve_tree(cfg, tree_config(cfg, tree_name, name), option_name)
            option.tree.check_heads(heads.config.num_heads)
            if isinstance(option.tree, GrownTree):   # a top_k the draft vocabulary cannot give fails here, not later
                tree_drafter(heads, option.tree)
            methods.append(Contender(f"{name}-{option_name}", Kind.HEADS, base, heads, option, name,
                                     heads.config.family, reference, option_name))
        module = heads.draft_module
        if hasattr(module, "to_causal_lm") and cfg.eval.get("sps_hf", {}).get("enabled"):
            # a draft model: transformers' assisted generation with it (its own layers, the base's LM head)
            twin = module.to_causal_lm(base)
            methods.append(Contender(f"{name}_hf", Kind.SPS_HF, base, heads_name=name, family=heads.config.family,
                                  reference=reference, assistant=twin))
    if sel.peers and cfg.eval.prompt_lookup.enabled:
        methods += [Contender("pld", Kind.PLD, model, reference="baseline"),
                    Contender("pld_hf", Kind.PLD_HF, model, reference="baseline")]
    if sel.peers and cfg.eval.get("hf_generate", {}).get("enabled"):
        # transformers' own greedy generate, no drafting, on its own paths (a stock copy of the weights, not
        # prepared below): the other autoregressive loop, checked against ours
        methods.append(Contender("hf_generate", Kind.HF_GENERATE, stock_copy(model), reference="baseline"))
    drafters = cfg.eval.get("drafters") if sel.peers else None
    for name, spec in (OmegaConf.to_container(drafters, resolve=True) if drafters else {}).items():
        make_drafter(spec)                # an unknown kind or a bad setting fails here, before any decoding
        methods.append(Contender(name, Kind.DRAFTER, model, reference="baseline", spec=spec))
    # every model decodes through the CPU fast paths (packed linears, GQA without cache copies), the baselines
    # too; after the LoRA merges, which change the weights
    for m in {id(m.model): m.model for m in methods if m.kind is not Kind.HF_GENERATE}.values():
        log.info("prepared %s for decoding: %s", m.config.name_or_path, prepare_for_decoding(m))
    for m in methods:
        if m.heads is not None:
            prepare_heads_for_decoding(m.heads)
    return methods


def tree_question_limits(cfg: DictConfig) -> dict:
    """profile.eval.tree_questions as a dict {tree option: number of questions} ({} when unset)."""
    node = cfg.profile.eval.get("tree_questions")
    return {} if node is None else OmegaConf.to_container(node)


def calibrated_choice(cfg: DictConfig, heads_name: str) -> str:
    """Which calibrated tree calibrate@<heads> chose for this machine: "fixed" (tree=optimal) or "grown"
    (tree=dynamic_optimal), from its choice.json."""
    path = Path(cfg.paths.results) / "calibrate" / heads_name / "choice.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: profile.eval.unchosen_questions runs the tree calibrate did not "
                                f"choose on fewer questions, and `dvc repro calibrate@{heads_name}` writes the choice")
    choice = json.loads(path.read_text()).get("choice")
    if choice not in ("fixed", "grown"):
        raise ValueError(f"{path}: choice {choice!r} is neither 'fixed' nor 'grown'")
    return choice


def unchosen_limits(cfg: DictConfig, m: Contender) -> int | None:
    """The questions a calibrated tree runs on when it is not the one calibrate chose for its heads
    (profile.eval.unchosen_questions; its families in profile.eval.both_choices keep both on every question);
    None: every question."""
    ev = cfg.profile.eval
    n, kinds = ev.get("unchosen_questions"), ev.get("choice_trees") or {}
    if n is None or m.heads_name is None or m.tree_name not in kinds or m.heads_name in (ev.get("both_choices") or []):
        return None
    return None if kinds[m.tree_name] == calibrated_choice(cfg, m.heads_name) else int(n)


def question_subsets(cfg: DictConfig, methods: list[Contender], questions) -> dict[str, set[int]]:
    """{method name: the question ids it runs on} for the methods whose tree is in profile.eval.tree_questions, the
    calibrated tree calibrate did not choose (profile.eval.unchosen_questions) and transformers' assisted generation
    with a draft model (profile.eval.assisted_questions)."""
    limits = tree_question_limits(cfg)
    subsets = {}
    assisted = cfg.profile.eval.get("assisted_questions")
    for m in methods:
        n = limits.get(m.tree_name) if m.tree_name in limits else unchosen_limits(cfg, m)
        if m.kind is Kind.SPS_HF:              # transformers' assisted generation: a reference, not a headline row
            n = assisted
        if n is not None:
            subsets[m.name] = {q.question_id for q in spread(questions, int(n))}
    return subsets


def random_heads(cfg: DictConfig, model, heads_cfg: DictConfig, seed: int = 0):
    """Fresh, untrained heads of `heads_cfg` (a conf/heads option) for `model`, to time or try the decoder (their
    acceptance means nothing): the profile's LM-head sharing and draft vocabulary, its lowest ids (the full
    vocabulary where the profile's is not smaller than the model's, as on a tiny model)."""
    vocab = OmegaConf.select(cfg, "profile.train.draft_vocab_size", default=None)
    vocab = None if vocab is None or int(vocab) >= model.config.vocab_size else int(vocab)
    share = bool(OmegaConf.select(cfg, "profile.share_lm_head", default=False))
    config = HeadsConfig.for_base(model, str(heads_cfg.family), int(heads_cfg.num_heads), int(heads_cfg.num_layers),
                                  share_lm_head=share, draft_vocab_size=vocab,
                                  shared_blocks=heads_cfg.get("shared_blocks", False),
                                  mask_token_id=heads_cfg.get("mask_token_id"),
                                  sample_from_anchor=heads_cfg.get("sample_from_anchor", False))
    torch.manual_seed(seed)
    heads = build_heads(config, model, None if vocab is None else torch.arange(vocab))
    return heads.to(next(model.parameters()).device).eval()
