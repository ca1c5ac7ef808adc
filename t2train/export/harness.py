"""``t2train eval CHECKPOINT --tasks ...``: lm-eval-harness tasks on a checkpoint of any design.

``RunModel`` is lm-eval's model interface over the checkpoint's model (TP = PP = 1, from
``load_model``) and the run's tokenizer, so every residual design is evaluated by the code
that trained it, not by an export. It answers lm-eval's three request types:

- log-likelihood of a continuation (multiple-choice tasks): the context is truncated on the
  left to the run's ``seq_length``, as lm-eval's own Hugging Face model does; requests are
  batched longest first and padded on the right, which changes no earlier position (every
  design is causal along the sequence, and the depth reads mix layers at one position);
- rolling log-likelihood (perplexity tasks): lm-eval's disjoint windows of ``seq_length``;
- generation up to the task's stop strings (greedy, or sampled when the task asks):
  requests that share their options are batched longest first, each new token fed alone
  against a KV cache of the earlier ones (``t2train/model/kv_cache.py``, exact for every
  design); each request gets the tokens it would get alone (``generate_batch``).

The run's BOS convention (``bos_id`` of its dataset) starts every context, as it started
every training document.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator, Optional
from unittest import mock

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM

from t2train.compat.library_noise import log_records_dropped, progress_bars_hidden
from t2train.errors import UserInputError
from t2train.export.generate import generate_batch
from t2train.export.load import LoadedModel
from t2train.export.tokenizer import RunTokenizer

# Seconds between two "answered N/M requests" lines of a long request type.
PROGRESS_EVERY_S = 30.0
# huggingface_hub's HTTP client, which logs each retry of an unreachable Hub.
HUB_HTTP_LOGGER = "huggingface_hub.utils._http"


class RunModel(TemplateLM):
    """A loaded checkpoint as an ``lm_eval`` language model; ``progress`` gets a line as each
    request type starts and every ``PROGRESS_EVERY_S`` while it runs (lm-eval's bars are off)."""

    def __init__(
        self,
        loaded: LoadedModel,
        tok: RunTokenizer,
        batch_size: int,
        progress: Callable[[str], None] = lambda stage: None,
    ):
        super().__init__()
        self.model, self.tok, self.batch_size = loaded.model, tok, batch_size
        self.context = loaded.checkpoint.config.model.seq_length
        self.vocab = tok.tokenizer.get_vocab_size()
        self._device = next(self.model.parameters()).device
        self.progress = progress
        self._kind, self._total, self._done, self._reported = "", 0, 0, 0.0

    def _answering(self, kind: str, total: int) -> None:
        self.progress(f"answering {total:,} {kind} requests")
        self._kind, self._total, self._done, self._reported = kind, total, 0, time.monotonic()

    def _answered(self, count: int) -> None:
        self._done += count
        now = time.monotonic()
        if now - self._reported >= PROGRESS_EVERY_S and self._done < self._total:
            self._reported = now
            self.progress(f"answered {self._done:,}/{self._total:,} {self._kind} requests")

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: the run's BOS, else its EOS (the previous document's end)."""
        return self.tok.eos_id if self.tok.bos_id is None else self.tok.bos_id

    def tok_encode(
        self, string: str, add_special_tokens: Optional[bool] = None, **kwargs
    ) -> list[int]:
        if add_special_tokens is False:
            return self.tok.tokenizer.encode(string, add_special_tokens=False).ids
        return self.tok.encode_prompt(string)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.tokenizer.decode(ids, skip_special_tokens=False)

    @torch.no_grad()
    def _log_probs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each row's next-token log-probabilities [len(row), vocab], one padded forward."""
        longest = max(len(row) for row in rows)
        ids = torch.full((len(rows), longest), self.tok.eos_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        ids = ids.to(self._device)
        positions = torch.arange(longest, device=self._device).expand_as(ids)
        logits = self.model(ids, positions, None)[..., : self.vocab].float()
        log_probs = F.log_softmax(logits, dim=-1).cpu()
        return [log_probs[i, : len(row)] for i, row in enumerate(rows)]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._answering("log-likelihood", len(requests))
        # without lm-eval's tokenizing bar: _answering reports the progress
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, counted: bool = True, **kwargs
    ):
        """``(sum of log p(continuation | context), whether greedy decoding gives it)`` each;
        ``counted``: each answer is one of the requests ``_answering`` announced."""
        inputs = []
        for _, context, continuation in requests:
            if not continuation:
                raise UserInputError(
                    "lm-eval asked for the log-likelihood of an empty "
                    "continuation; the task's choices must not be empty"
                )
            whole = (context + continuation)[-(self.context + 1) :]
            kept = min(len(continuation), len(whole) - 1)  # the rest fell off the left
            inputs.append((whole[:-1], continuation[len(continuation) - kept :]))
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        answers: list[Optional[tuple[float, bool]]] = [None] * len(inputs)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            rows = self._log_probs([inputs[i][0] for i in batch])
            for i, log_probs in zip(batch, rows):
                continuation = torch.tensor(inputs[i][1])
                scored = log_probs[-len(continuation) :]
                total = float(scored.gather(1, continuation[:, None]).sum())
                greedy = bool((scored.argmax(-1) == continuation).all())
                answers[i] = (total, greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], answers[i])
            if counted:
                self._answered(len(batch))
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        self._answering("rolling log-likelihood", len(requests))
        totals = []
        for request in requests:
            (text,) = request.args
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.context,
                    context_len=1,
                )
            ]
            scored = self._loglikelihood_tokens(
                [(None, *window) for window in windows], counted=False
            )
            totals.append(sum(total for total, _ in scored))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), totals[-1])
            self._answered(1)
        return totals

    def _stops_at(self, until: list[str]) -> Callable[[list[int]], bool]:
        """Whether new ids decode to text holding one of ``until``."""
        return lambda ids: any(stop in self.tok_decode(ids) for stop in until)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self._answering("generation", len(requests))
        texts: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}  # requests with the same generation options
        for i, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            options = requests[members[0]].args[1]
            until = options.get("until") or [self.tok.eos_token]
            until = [until] if isinstance(until, str) else list(until)
            sampled = bool(options.get("do_sample")) or options.get("temperature", 0) > 0
            prompts = {i: self.tok_encode(requests[i].args[0]) for i in members}
            order = sorted(members, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                generated = generate_batch(
                    self.model,
                    [prompts[i] for i in batch],
                    int(options.get("max_gen_toks", 256)),
                    self.vocab,
                    self.context,
                    self.tok.eos_id,
                    top_p=float(options.get("top_p", 1.0)) if sampled else None,
                    temperature=float(options.get("temperature") or 1.0),
                    seed=int(options.get("seed", 0)),
                    stop=self._stops_at(until),
                )
                for i, new in zip(batch, generated):
                    text = self.tok.tokenizer.decode(new, skip_special_tokens=True)
                    for stop in until:
                        text = text.split(stop)[0]
                    texts[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                self._answered(len(batch))
        return texts


def task_manager(tasks: list[str], include_path: Optional[str]):
    """lm-eval's task index with the user's folder, once every name in ``tasks`` is in it."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notes on defaults
    if include_path is not None and not Path(include_path).exists():
        raise UserInputError(f"--include-path {include_path}: no such file or directory")
    manager = TaskManager(include_path=include_path)
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        where = f" or in --include-path {include_path}" if include_path else ""
        raise UserInputError(
            f"--tasks: {', '.join(unknown)} is not a task lm-eval knows{where} "
            "(lm-eval ls tasks lists them)"
        )
    return manager


def run_tasks(
    model: RunModel,
    tasks: list[str],
    manager,
    num_fewshot: Optional[int],
    limit: Optional[float],
    progress: Callable[[str], None] = lambda stage: None,
) -> dict:
    """lm-eval's results for ``tasks``, with its standard errors; a one-line error if their
    data cannot be fetched."""
    from lm_eval import simple_evaluate

    progress(f"reading the data of {', '.join(tasks)} (from the Hugging Face Hub unless cached)")
    try:
        with (
            progress_bars_hidden(),
            _run_records_skipped(),
            # a note per retry, two long lines each, before the error below says it once
            log_records_dropped(HUB_HTTP_LOGGER, r"thrown while requesting|Retrying in"),
        ):
            return simple_evaluate(
                model=model,
                tasks=tasks,
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=manager,
                log_samples=False,
            )
    except ConnectionError as err:  # datasets' "Couldn't reach '<dataset>' on the Hub (...)"
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserInputError(
            f"--tasks {','.join(tasks)}: their data cannot be fetched ({cause}); run once where "
            "the Hub is reachable and copy its Hugging Face cache (HF_HOME, default "
            "~/.cache/huggingface) here, then HF_HUB_OFFLINE=1 reads the data from it; or give "
            "--include-path a task YAML whose dataset_path is a local folder of the data files"
        ) from None


@contextlib.contextmanager
def _run_records_skipped() -> Iterator[None]:
    """Without what lm-eval records of where it ran, which ``write_results`` keeps none of: the
    current directory's git hash (``git describe``, whose "fatal: not a git repository" goes
    to the console outside a repository) and torch's environment report (seconds of probing
    subprocesses)."""
    from lm_eval import evaluator

    with contextlib.ExitStack() as stack:
        for name, stand_in in (
            ("get_git_commit_hash", lambda: None),
            ("add_env_info", lambda storage: None),
        ):
            if hasattr(evaluator, name):  # another lm-eval version may have neither
                stack.enter_context(mock.patch.object(evaluator, name, stand_in))
        yield


def write_results(results: dict, out: Path) -> None:
    """The scores per task and the settings lm-eval records, as JSON."""
    keep = {
        key: results[key] for key in ("results", "versions", "n-shot", "configs") if key in results
    }
    out.write_text(json.dumps(keep, indent=2, default=str) + "\n")
