"""Online reinforcement learning: GRPO (``--stage grpo``), rollouts from the policy being trained.

Each iteration (Shao et al. 2024, DeepSeekMath; the flags as TRL's GRPOTrainer names them):
1. --global-batch-size prompts (each data-parallel rank a share) from instruction data: a
   sample's prompt is its tokens before the reply, the reply is the reference answer;
2. the policy, as it is now and in the same processes and layout (no copy of the weights to a
   second engine), draws --num-generations completions of each, up to
   --max-completion-length tokens (models/generate.py, its key/value cache, the run's
   --temperature / --top-k / --top-p; each completion's draws seeded by --seed, its sample's
   number and its own, so any layout draws the same rollouts);
3. each completion is scored by --reward-funcs (``accuracy``: its final answer, after ``####``
   or in ``\\boxed{}``, equals the reference's; ``format``: ``<think>...</think>`` then an
   answer; or ``package.module:function``, called as ``function(completions, references,
   prompts) -> [float]``) and by --reward-model (an outcome reward model of --stage orm: its
   value at the completion's last token), weighted by --reward-weights and summed;
4. a completion's advantage is its reward minus its group's mean (a group: the completions of
   one prompt), divided by the group's standard deviation + 1e-4 (--scale-rewards group; none:
   not divided, as Dr. GRPO);
5. --ppo-epochs optimizer steps over the rollouts (micro-batches of --micro-batch-size
   completions) minimise, per completion token t,

       -min(r_t A, clip(r_t, 1 - e, 1 + e_high) A) + kl_coef * (exp(q_t) - q_t - 1),
       r_t = exp(log p_t - log p_old_t),  q_t = log p_ref_t - log p_t  (the k3 KL estimator)

   (every p at --temperature, the distribution the completions were drawn from, as TRL has it;
   --use-bias-correction-kl multiplies the KL term by r_t, DeepSeek-V3.2's unbiased estimate of
   the reverse KL's gradient, on by default in TRL 1.x)

   where p_old is the policy that drew the completions and p_ref the model the run started
   from. --grpo-loss-type says how tokens are averaged: grpo (each completion's mean, then
   the mean over completions), bnpo (the mean over the micro-batch's tokens), dr_grpo (the
   sum over tokens / (completions x --max-completion-length)), dapo (the mean over the step's
   tokens, all micro-batches and ranks: TRL's default).

The reference log-probabilities are computed with the starting weights, kept on the host (this
rank's shards) and put in the model for that forward only, so no second model is held. The
old ones: with one epoch, the policy that drew the completions is the one being differentiated,
so r_t = 1 and only its gradient counts (the detached log-probability is used); with more, a
no-gradient forward before the first update records them.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import time
from dataclasses import dataclass

import numpy as np

from mindspeed_core import autograd, features, nn, ops
from mindspeed_core.data.handlers import IGNORE
from mindspeed_core.errors import MindSpeedError

STATS = ("clip_fraction", "kl")  # the objective's per-step figures, over completion tokens
SCALE_EPS = 1e-4  # added to a group's standard deviation (as TRL)


# ---- rewards ---------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKED = re.compile(r"####\s*([^\n]*)")


def final_answer(text: str) -> str | None:
    """The answer a text gives: the last ``\\boxed{...}``, else what follows the last ``####``
    (GSM8K's mark), normalised (spaces, thousands' commas and a final full stop dropped; a
    number written as one, 3.0 as 3); None without either mark."""
    found = _BOXED.findall(text) or _MARKED.findall(text)
    if not found:
        return None
    answer = found[-1].strip().replace(",", "").rstrip(".").strip()
    try:
        number = float(answer)
    except ValueError:
        return " ".join(answer.split())
    return str(int(number)) if number.is_integer() else repr(number)


def accuracy_reward(completions: list[str], references: list[str | None], prompts: list[str]) -> list[float]:
    """1 where the completion's final answer equals the reference's (a reference without a
    mark is the answer itself), else 0."""
    out = []
    for completion, reference in zip(completions, references):
        if reference is None:
            raise MindSpeedError("--reward-funcs accuracy needs reference answers: instruction data whose replies "
                                 "hold them (e.g. GSM8K's '#### 42')")
        want = final_answer(reference)
        if want is None:
            want = final_answer(f"#### {reference}")
        out.append(float(want is not None and final_answer(completion) == want))
    return out


_THINK = re.compile(r"\s*<think>.*?</think>\s*\S.*", re.DOTALL)


def format_reward(completions: list[str], references: list[str | None], prompts: list[str]) -> list[float]:
    """1 where the completion is ``<think>...</think>`` followed by an answer, else 0."""
    return [float(_THINK.fullmatch(c) is not None) for c in completions]


BUILT_IN = {"accuracy": accuracy_reward, "format": format_reward}


def reward_functions(names: list[str]) -> list[tuple[str, object]]:
    """(name, function) for each --reward-funcs entry: a built-in or ``module:function``."""
    out = []
    for name in names:
        if name in BUILT_IN:
            out.append((name, BUILT_IN[name]))
            continue
        module, _, attribute = name.partition(":")
        if not module or not attribute:
            raise MindSpeedError(f"--reward-funcs {name}: not one of {', '.join(BUILT_IN)}, nor package.module:function")
        try:
            fn = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as e:
            raise MindSpeedError(f"--reward-funcs {name}: cannot import it ({e})") from None
        if not callable(fn):
            raise MindSpeedError(f"--reward-funcs {name}: not a function")
        out.append((name, fn))
    return out


def read_reward_model(path: str, weights: bool = True):
    """--reward-model: the whole model (a Source, training/model_source.py) of an outcome reward
    model, checked to be one; ``weights=False``: its configuration alone (the check before any
    rank starts)."""
    from mindspeed_core.training import model_source

    if weights:
        source = model_source.read(path, "--reward-model", ("ours", "hf")).merged()
        cfg = source.cfg
    else:
        source = cfg = model_source.read_config(path, "--reward-model", ("ours", "hf"))
    if not cfg.reward_head:
        raise MindSpeedError(f"--reward-model {path} is a language model, not a reward model (train one with "
                             "--stage orm)")
    return source


def check_reward_vocabulary(path: str, cfg, vocab_size: int) -> None:
    """The reward model must read the policy's token ids: the same (padded) vocabulary."""
    if cfg.vocab_size != vocab_size:
        raise MindSpeedError(f"--reward-model {path} has a vocabulary of {cfg.vocab_size} tokens, the policy "
                             f"{vocab_size}: it must read the same token ids (train it with the policy's tokenizer "
                             "and --make-vocab-size-divisible-by)")


class RewardModel:
    """An outcome reward model (--stage orm) scoring completions: its value where it has read a
    completion's last token (alignment.last_token_values, as it was trained). Cut for the run's
    tensor parallelism (``ps``: every rank of a TP group scores the same rows, each with its
    shard), whole on every other axis, without gradients."""

    def __init__(self, path: str, vocab_size: int, ps=None):
        from mindspeed_core.models import registry
        from mindspeed_core.models.gpt import load_whole_state
        from mindspeed_core.parallel.parallelize import parallelize

        source = read_reward_model(path)
        check_reward_vocabulary(path, source.cfg, vocab_size)
        self.cfg = source.cfg
        spec = registry.for_config(source.cfg)
        self.model = spec.build(source.cfg)
        load_whole_state(self.model, source.state)
        if ps is not None and ps.tp > 1:
            parallelize(spec, self.model, ps, False, cp_algo=None)
        nn.set_training(self.model, False)

    def score(self, ids: np.ndarray, mask: np.ndarray, size: int) -> np.ndarray:
        """[rows] float64: each training row's value (``mask``: 1 at the completion's labels)."""
        from mindspeed_core.training.alignment import last_token_values

        out = []
        with autograd.no_grad():
            for start in range(0, ids.shape[0], size):
                cut = slice(start, start + size)
                values = self.model(ops.tensor(np.ascontiguousarray(ids[cut])))
                values = ops.reshape(ops.cast(values, "float32"), values.shape[:2])
                out.append(ops.to_numpy(last_token_values(values, mask[cut])))
        return np.concatenate(out).astype(np.float64)


def score(functions, weights, completions, references, prompts) -> tuple[np.ndarray, np.ndarray]:
    """(the weighted total [n], each function's rewards [functions, n])."""
    each = []
    for (name, fn), weight in zip(functions, weights):
        try:
            values = fn(completions, references, prompts)
        except MindSpeedError:  # a built-in's refusal, already one line
            raise
        except Exception as e:  # the user's code: its error, named, is the run's one line
            said = str(e).strip().splitlines()
            raise MindSpeedError(f"reward function {name} raised {type(e).__name__}"
                                 + (f": {said[0]}" if said else "")) from None
        try:
            values = np.asarray(values, np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise MindSpeedError(f"reward function {name} returned {type(values).__name__}, not a list of numbers") \
                from None
        if values.shape != (len(completions),) or not np.isfinite(values).all():
            raise MindSpeedError(f"reward function {name} must return one finite number per completion "
                                 f"({len(completions)}), got {values.shape[0]} values")
        each.append(values)
    each = np.stack(each) if each else np.zeros((0, len(completions)))
    return np.asarray(weights[:len(functions)], np.float64) @ each, each


def group_advantages(rewards: np.ndarray, group: int, scale: str = "group") -> np.ndarray:
    """Each reward minus its group's mean (groups: ``group`` consecutive completions of one
    prompt), divided by the group's standard deviation (ddof 1, as torch.std) + SCALE_EPS
    when ``scale`` is "group"."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    advantages = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        advantages = advantages / ((r.std(axis=1, ddof=1, keepdims=True) if group > 1 else 0.0) + SCALE_EPS)
    return advantages.reshape(-1)


# ---- the objective ---------------------------------------------------------------------------

@dataclass
class Rollout:
    """The target of a micro-batch of completions: ``labels`` [rows, S] (the model's layout),
    host numpy ``mask`` [rows, S] (1 at completion tokens), ``advantages`` [rows], and the
    per-token log-probabilities of the policy that drew them (``old``) and of the reference
    (``reference``), [rows, S] each or None (old: the policy itself, detached; reference: no KL)."""

    labels: object
    mask: np.ndarray
    advantages: np.ndarray
    old: np.ndarray | None = None
    reference: np.ndarray | None = None
    # dapo: the step's completion tokens (all micro-batches, all data-parallel ranks) over its
    # micro-batches, so the mean of the micro-batches' losses is the sum over tokens / their count
    tokens_per_micro_batch: float = 1.0
    # under context parallelism: the columns of each row this rank holds (labels are those
    # already; mask, old and reference stay whole), and the number of CP ranks
    columns: np.ndarray | None = None
    shards: int = 1


def token_log_probs(model, logits, labels, rows: int, length: int, temperature: float = 1.0):
    """log p(label) at every position, [rows, length] float32, differentiable (a vocabulary
    shard's logits under TP: the seam gathers what it needs), of the distribution the rollouts
    are drawn from: softmax(logits / temperature), as TRL computes them."""
    flat = ops.reshape(ops.cast(logits, "float32"), (-1, logits.shape[-1]))
    if temperature != 1.0:
        flat = flat * (1.0 / temperature)
    return -ops.reshape(model.seams.token_losses(flat, ops.reshape(labels, (-1,))), (rows, length))


@dataclass(frozen=True)
class Settings:
    """GRPO's flags, resolved (TRL's GRPOTrainer names where it has them)."""
    num_generations: int
    max_completion_length: int
    temperature: float
    top_k: int
    top_p: float
    clip_ratio: float  # the lower clip, 1 - eps
    clip_ratio_high: float  # the upper, 1 + eps_high (DAPO's clip-higher; --clip-ratio when not given)
    kl_coef: float
    loss_type: str  # grpo, bnpo, dr_grpo or dapo
    kl_correction: bool  # --use-bias-correction-kl
    scale_rewards: str  # group or none
    ppo_epochs: int
    reward_funcs: tuple
    reward_model: str | None
    reward_weights: tuple  # one per reward function, then the reward model's


class Objective:
    """GRPO's loss of one micro-batch of completions (the module docstring's formula)."""

    def __init__(self, settings: Settings):
        self.low, self.high = settings.clip_ratio, settings.clip_ratio_high
        self.beta, self.loss_type = settings.kl_coef, settings.loss_type
        self.kl_correction = settings.kl_correction
        self.max_length, self.temperature = settings.max_completion_length, settings.temperature
        self.stats: list[np.ndarray] = []

    def token_weights(self, mask: np.ndarray, tokens_per_micro_batch: float) -> np.ndarray:
        """[rows, S] float64: each token's weight in the micro-batch's loss (the loss is the sum of
        weight x per-token loss), by --grpo-loss-type, from the whole rows' mask."""
        rows = mask.shape[0]
        if self.loss_type == "grpo":  # per completion, then the mean over completions
            return mask / (np.maximum(mask.sum(axis=1, keepdims=True), 1.0) * rows)
        if self.loss_type == "bnpo":  # over the micro-batch's tokens
            return mask / max(float(mask.sum()), 1.0)
        if self.loss_type == "dr_grpo":  # over completions x the length cap
            return mask / (rows * self.max_length)
        return mask / tokens_per_micro_batch  # dapo: over the step's completion tokens, every micro-batch and rank

    def __call__(self, model, out, target: Rollout, tokens=None):
        features.note_used("stage-grpo")
        local = slice(None) if target.columns is None else target.columns
        whole = np.asarray(target.mask, np.float64)
        weights = self.token_weights(whole, target.tokens_per_micro_batch)[:, local] * target.shards
        mask = whole[:, local]
        rows, length = mask.shape
        logp = token_log_probs(model, out, target.labels, rows, length, self.temperature)
        old = autograd.detach(logp) if target.old is None else ops.tensor(np.asarray(target.old[:, local], np.float32))
        ratio = ops.exp(logp - old)
        advantage = ops.tensor(np.asarray(target.advantages, np.float32).reshape(rows, 1))
        surrogate = ops.minimum(ratio * advantage, ops.clamp(ratio, 1.0 - self.low, 1.0 + self.high) * advantage)
        per_token = -surrogate
        kl = None
        if self.beta:
            if target.reference is None:
                raise RuntimeError("a GRPO micro-batch without reference log-probabilities")
            q = ops.tensor(np.asarray(target.reference[:, local], np.float32)) - logp
            kl = ops.exp(q) - q - 1.0
            # DeepSeek-V3.2's unbiased reverse-KL gradient (TRL's default): weighted by the ratio
            per_token = per_token + (kl * ratio if self.kl_correction else kl) * self.beta
        # under context parallelism each rank sums its columns, times the CP ranks: the trainer
        # averages over them (as loss_from_logits)
        loss = ops.sum(per_token * ops.tensor(weights.astype(np.float32)))
        self._record(ops.to_numpy(autograd.detach(ratio)), target.advantages, mask, max(float(whole.sum()), 1.0),
                     None if kl is None else ops.to_numpy(autograd.detach(kl)))
        return loss

    def _record(self, ratio, advantages, mask, tokens: float, kl) -> None:
        """The clip fraction and the KL over the micro-batch's ``tokens`` completion tokens (a
        CP rank's share of them: the shares are summed)."""
        a = np.asarray(advantages).reshape(-1, 1)
        clipped = ((ratio < 1.0 - self.low) & (a < 0)) | ((ratio > 1.0 + self.high) & (a > 0))
        self.stats.append(np.array([float((clipped * mask).sum()) / tokens,
                                    0.0 if kl is None else float((kl * mask).sum()) / tokens]))

    def take_stats(self) -> np.ndarray | None:
        if not self.stats:
            return None
        out, self.stats = np.mean(self.stats, axis=0), []
        return out


# ---- rollouts --------------------------------------------------------------------------------

def prompt_and_reference(tokens: np.ndarray, labels: np.ndarray, documents: np.ndarray,
                         tokenizer) -> tuple[list[int], str | None]:
    """An instruction sample's prompt (its tokens before the first trained label) and reference
    (the trained labels' text, the end-of-document token left out); a sample of prompts only
    (labels all IGNORE) has no reference."""
    if documents.max() > 0:
        raise MindSpeedError("--stage grpo reads one conversation per sample: preprocess the prompts without --pack")
    trained = np.flatnonzero(labels != IGNORE)
    if not trained.size:  # the sample's tokens are the prompt (its padding: documents -1)
        return [int(t) for t in tokens[documents >= 0]], None
    answer = [int(t) for t in labels[trained] if int(t) != getattr(tokenizer, "eod", None)]
    return [int(t) for t in tokens[:trained[0]]], tokenizer.decode(answer)


class Rollouts:
    """One iteration's completions on this data-parallel rank, as training rows."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, mask: np.ndarray, advantages: np.ndarray,
                 stats: dict):
        self.ids, self.labels, self.mask, self.advantages, self.stats = ids, labels, mask, advantages, stats
        self.old: np.ndarray | None = None
        self.reference: np.ndarray | None = None
        self.tokens_per_micro_batch = 1.0  # dapo's (Rollout); the trainer sets it

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    def micro_batch(self, start: int, size: int, columns: np.ndarray | None = None, shards: int = 1):
        """(ids, Rollout, None) of rows [start, start + size); ``columns``: only these columns of
        the ids and labels (a context-parallel rank's, of ``shards``)."""
        cut = slice(start, start + size)
        local = slice(None) if columns is None else columns
        target = Rollout(ops.tensor(np.ascontiguousarray(self.labels[cut][:, local])), self.mask[cut],
                         self.advantages[cut], None if self.old is None else self.old[cut],
                         None if self.reference is None else self.reference[cut], self.tokens_per_micro_batch,
                         columns, shards)
        return ops.tensor(np.ascontiguousarray(self.ids[cut][:, local])), target, None


def rows_of(prompts: list[list[int]], completions: list[list[int]], ended: list[bool], width: int, pad: int,
            eod: int | None):
    """Training rows (ids, labels, mask), each [n, width]: prompt + completion (+ the stop token
    where the completion ended on it), shifted by one as the language-model loss reads them."""
    n = len(completions)
    tokens = np.full((n, width + 1), pad, np.int64)
    labels = np.full((n, width + 1), IGNORE, np.int64)
    for i, (prompt, completion, stop) in enumerate(zip(prompts, completions, ended)):
        reply = completion + ([eod] if stop and eod is not None else [])
        row = prompt + reply
        tokens[i, :len(row)] = row
        labels[i, len(prompt):len(row)] = reply
    mask = (labels[:, 1:] != IGNORE).astype(np.float32)
    return tokens[:, :-1], np.where(labels[:, 1:] == IGNORE, 0, labels[:, 1:]), mask


def draw(model, tokenizer, samples: list, indices: list[int], settings: Settings, functions,
         reward_model: RewardModel | None = None, *, seq_length: int, micro_batch_size: int, seed: int) -> Rollouts:
    """Generate and score one iteration's completions for ``samples`` [(tokens, labels,
    documents)], the data's samples number ``indices``: completion g of sample i draws from a
    generator seeded by (``seed``, i, g), so it is the same whichever rank, batch or layout draws it."""
    from mindspeed_core.models import generate as gen

    group, weights = settings.num_generations, settings.reward_weights
    prompts, references = zip(*(prompt_and_reference(*sample, tokenizer) for sample in samples))
    longest = max(len(p) for p in prompts)
    if longest + settings.max_completion_length + 1 > seq_length + 1:
        raise MindSpeedError(f"a prompt of {longest} tokens and --max-completion-length "
                             f"{settings.max_completion_length} (and a stop token) do not fit --seq-length "
                             f"{seq_length}: raise --seq-length or lower --max-completion-length")
    every = [list(p) for p in prompts for _ in range(group)]
    eod = getattr(tokenizer, "eod", None)
    sampling = gen.Sampling(greedy=False, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    seeds = [[seed, index, g] for index in indices for g in range(group)]
    started = time.perf_counter()
    entropies = []  # each step's, per row: of the distribution drawn from (at --temperature, before top-k/p)
    with evaluating(model):
        completions = gen.generate(model, every, settings.max_completion_length, sampling,
                                   stop_ids=() if eod is None else (eod,), pad_id=0, row_seeds=seeds,
                                   on_logits=lambda logits: entropies.append(entropy(logits / settings.temperature)))
    generation = time.perf_counter() - started
    ended = [len(c) < settings.max_completion_length for c in completions]
    drawn = np.arange(len(entropies))[:, None] < np.array([len(c) + e for c, e in zip(completions, ended)])[None]
    texts = [tokenizer.decode(c) for c in completions]
    prompt_texts = [tokenizer.decode(p) for p in every]
    refs = [r for r in references for _ in range(group)]
    total, each = score(functions, weights, texts, refs, prompt_texts)
    ids, labels, mask = rows_of(every, completions, ended, seq_length, 0, eod)
    stats = {f"reward_{name.replace(':', '_').replace('.', '_')}": float(v.mean())
             for (name, _), v in zip(functions, each)}
    if reward_model is not None:
        values = reward_model.score(ids, mask, micro_batch_size)
        total = total + weights[len(functions)] * values
        stats["reward_model"] = float(values.mean())
    stats.update(reward=float(total.mean()), reward_std=float(total.std()),
                 completion_length=float(np.mean([len(c) for c in completions])), generation_seconds=generation,
                 entropy=float((np.stack(entropies) * drawn).sum() / max(drawn.sum(), 1)))
    return Rollouts(ids, labels, mask, group_advantages(total, group, settings.scale_rewards), stats)


def entropy(logits: np.ndarray) -> np.ndarray:
    """Each row's entropy (nats) of softmax(logits), [rows, vocab] -> [rows]."""
    from mindspeed_core.models.generate import log_softmax

    logp = log_softmax(logits)  # float64
    return -(np.exp(logp) * logp).sum(axis=-1)


def log_probs(model, rollouts: Rollouts, size: int, temperature: float) -> np.ndarray:
    """Per-token log-probabilities [rows, S] of the rollouts' rows under ``model`` at
    ``temperature``, no gradient."""
    out = []
    with evaluating(model), autograd.no_grad():
        for start in range(0, rollouts.rows, size):
            ids, target, _ = rollouts.micro_batch(start, size)
            rows, length = target.mask.shape
            out.append(ops.to_numpy(token_log_probs(model, model(ids), target.labels, rows, length, temperature)))
    return np.concatenate(out).astype(np.float32)


@contextlib.contextmanager
def evaluating(model):
    """Drawing or scoring: no dropout, and whole sequences (under context parallelism the
    chunks run with the seams inside the CP ones: every CP rank computes the whole rows, as
    the key/value cache needs). ``model``, or under pipeline parallelism each of this rank's
    chunks (training/schedules.py StagedModel)."""
    modules = getattr(model, "chunks", None) or [model]
    seams = [module.seams for module in modules]
    for module in modules:
        nn.set_training(module, False)
        if module.seams.context_shards > 1:
            module.use_seams(module.seams.inner)
    try:
        yield
    finally:
        for module, own in zip(modules, seams):
            nn.set_training(module, True)
            module.use_seams(own)


class Reference:
    """The starting weights of this rank's parameters, on the host; ``log_probs`` puts them in
    the model for one forward and the trained ones back."""

    def __init__(self, params):
        self.params = list(params)
        self.values = [ops.to_numpy(p).copy() for p in self.params]

    def log_probs(self, model, rollouts: Rollouts, size: int, temperature: float) -> np.ndarray:
        now = [ops.to_numpy(p).copy() for p in self.params]
        try:
            for p, v in zip(self.params, self.values):
                nn.assign(p, ops.tensor(v))
            return log_probs(model, rollouts, size, temperature)
        finally:
            for p, v in zip(self.params, now):
                nn.assign(p, ops.tensor(v))
