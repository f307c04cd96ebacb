"""Reliable HTTP calls for remote rewards (GenEval server, VLM judges).

One place for what every remote reward needs: a timeout per attempt, retries with exponential
backoff, bounded concurrency, per-call statistics, and a stop after N consecutive failed batches.

Failure policy (DESIGN.md, "Reward"): a sample the endpoint could not score is returned as
``None`` by :meth:`RemoteEndpoint.map` and becomes NaN in the reward, so the module drops it from
the advantage computation; it is never scored 0. A batch in which *no* item succeeded is a failed
batch; after ``max_consecutive_failures`` of them in a row the endpoint raises
:class:`RemoteRewardError`, which stops the run with the endpoint, the error and the fix.

Written on the standard library's ``urllib`` so that the core needs no HTTP dependency.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from lit_flowgrpo.errors import SettingsError

log = logging.getLogger(__name__)

T = TypeVar("T")
Item = TypeVar("Item")

# Statuses worth another attempt: the server is overloaded or hit a transient error. Any other
# 4xx means the request itself is wrong and will fail the same way again.
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """A remote reward endpoint failed too many batches in a row: the run must stop."""


class RequestFailed(Exception):
    """One request failed after all its attempts; ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Attempt(Exception):
    def __init__(self, reason: str, retryable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


@dataclass
class CallStats:
    """What the last :meth:`RemoteEndpoint.map` call did."""

    items: int = 0
    """Requests made (one per item)."""
    failures: int = 0
    """Items that failed after all their attempts."""
    latency_s: float = 0.0
    """Wall time of the whole call."""
    last_error: str = ""
    """The reason of the last failure, empty when none failed."""


def decode_json(raw: bytes) -> Any:
    """Parse a JSON body; a malformed one raises ``ValueError`` (a retryable failure)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"malformed JSON response ({err}); body starts {raw[:80]!r}") from err


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <api_key>``, or no header without a key (local servers)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def chat_body(
    model: str,
    content: list[dict[str, Any]],
    max_tokens: int,
    temperature: float,
    extra_body: Mapping[str, Any] | None = None,
) -> bytes:
    """The JSON body of an OpenAI-compatible ``chat/completions`` request: one user message of ``content``
    parts, after any ``extra_body`` fields (which the named fields override)."""
    payload = {
        **(extra_body or {}),
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    return json.dumps(payload).encode("utf-8")


def chat_settings_problems(
    flag: str, score_max: float, image_format: str, extra_body: Mapping[str, Any] | None
) -> list[str]:
    """Problems with the settings every chat judge has (empty when fine), each naming ``flag``'s field: the
    score's divisor, the images' encoding, and ``extra_body`` fields that :func:`chat_body` would override."""
    out = []
    if not score_max > 0:
        out.append(f"{flag}.score_max ({score_max}) must be positive")
    if image_format not in ("png", "jpeg"):
        out.append(f"{flag}.image_format ({image_format!r}) must be 'png' or 'jpeg'")
    clash = sorted({"model", "messages"} & set(extra_body or {}))
    if clash:
        out.append(f"{flag}.extra_body sets {clash}: those come from the other settings")
    return out


def chat_reply(raw: bytes) -> Any:
    """The first choice's ``message.content`` of a chat completion (``None`` where the server sent null);
    a body that is not one raises ``ValueError`` (a retryable failure)."""
    reply = decode_json(raw)
    try:
        return reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(
            f"not a chat completion (no choices[0].message.content): {str(reply)[:120]}"
        ) from err


class RemoteEndpoint:
    """An HTTP endpoint called with timeouts, retries, bounded concurrency and failure counting.

    Args:
        url: base URL, ``http://`` or ``https://``.
        flag: the config path of the reward that owns this endpoint (``--model.init_args.reward.init_args.config.geneval``),
            named in every error so the user knows what to fix.
        timeout_s: limit of one attempt (connect + response), seconds.
        max_retries: further attempts after a failed one (timeouts, connection errors, 5xx/429,
            malformed responses); a 4xx other than 408/425/429 is not retried.
        backoff_s: sleep before the first retry; doubles for each further one.
        backoff_max_s: cap on one sleep.
        max_concurrency: requests in flight at once.
        max_consecutive_failures: failed batches (no item succeeded) in a row before
            :class:`RemoteRewardError` stops the run.
        headers: extra HTTP headers (e.g. ``Authorization``).
        url_key: the name of the owner's URL argument, for error messages.
    """

    def __init__(
        self,
        url: str,
        *,
        flag: str,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        max_concurrency: int = 8,
        max_consecutive_failures: int = 3,
        headers: Mapping[str, str] | None = None,
        url_key: str = "url",
    ) -> None:
        problems = []
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            problems.append(f"{flag}.{url_key} ({url!r}) must be an http:// or https:// URL")
        if not timeout_s > 0:
            problems.append(f"{flag}.timeout_s ({timeout_s}) must be positive")
        if max_retries < 0:
            problems.append(f"{flag}.max_retries ({max_retries}) must be 0 or more")
        if backoff_s < 0 or backoff_max_s < 0:
            problems.append(f"{flag}.backoff_s / backoff_max_s must be 0 or more")
        if max_concurrency < 1:
            problems.append(f"{flag}.max_concurrency ({max_concurrency}) must be at least 1")
        if max_consecutive_failures < 1:
            problems.append(
                f"{flag}.max_consecutive_failures ({max_consecutive_failures}) must be at least 1"
            )
        if problems:
            raise ValueError("; ".join(problems))
        self.url = url.rstrip("/")
        self.flag = flag
        self.url_flag = f"{flag}.{url_key}"
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_concurrency = int(max_concurrency)
        self.max_consecutive_failures = int(max_consecutive_failures)
        self.headers = dict(headers or {})
        self.consecutive_failures = 0
        self.last_stats = CallStats()
        self._lock = threading.Lock()

    def _full_url(self, path: str) -> str:
        return self.url if not path else f"{self.url}/{path.lstrip('/')}"

    def check(self, path: str = "") -> None:
        """Fail early, before the first rollout, when the endpoint cannot be reached.

        Any HTTP answer counts as reachable (a POST-only server answers GET with 404/405); a refused
        connection, an unknown host or a timeout raises a ``ValueError`` naming the flag.
        """
        url = self._full_url(path)
        request = urllib.request.Request(url, headers=self.headers, method="GET")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise SettingsError(
                f"{self.url_flag} ({self.url}) is unreachable: {reason}. Start the server, or fix the "
                "URL/port (the check runs once before the first rollout)"
            ) from err

    def request(
        self,
        path: str,
        body: bytes,
        content_type: str,
        parse: Callable[[bytes], T],
    ) -> T:
        """POST ``body`` and return ``parse(response body)``, retrying with exponential backoff.

        Raises:
            RequestFailed: every attempt failed (or one failed in a way a retry cannot fix).
        """
        url = self._full_url(path)
        headers = {"Content-Type": content_type, **self.headers}
        reason = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                # Exponential backoff as in urllib3's Retry (backoff_factor · 2^(n-1)), capped.
                time.sleep(min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                return parse(self._attempt(url, body, headers))
            except _Attempt as err:
                reason = err.reason
                if not err.retryable:
                    break
            except (ValueError, KeyError, TypeError, IndexError) as err:
                reason = f"bad response from {url}: {err}"
            log.debug("attempt %d on %s failed: %s", attempt + 1, url, reason)
        raise RequestFailed(f"{reason} (after {attempt + 1} attempt(s))")

    def _attempt(self, url: str, body: bytes, headers: dict[str, str]) -> bytes:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            detail = err.read(200).decode("utf-8", "replace") if err.fp is not None else ""
            raise _Attempt(
                f"HTTP {err.code} from {url}: {detail}".strip(), err.code in _RETRY_STATUS
            ) from err
        except TimeoutError as err:
            raise _Attempt(f"timed out after {self.timeout_s}s on {url}", True) from err
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise _Attempt(f"timed out after {self.timeout_s}s on {url}", True) from err
            raise _Attempt(f"cannot reach {url}: {err.reason}", True) from err
        except OSError as err:  # connection reset or closed mid-response
            raise _Attempt(f"connection error on {url}: {err}", True) from err

    def map(self, fn: Callable[[Item], T], items: Sequence[Item]) -> list[T | None]:
        """``fn`` over ``items`` with at most ``max_concurrency`` in flight; a failed item is ``None``.

        ``fn`` normally calls :meth:`request`; a :class:`RequestFailed` or ``ValueError`` it raises
        marks the item failed. Updates :attr:`last_stats` and the consecutive-failure count, and
        raises :class:`RemoteRewardError` once ``max_consecutive_failures`` batches in a row failed.
        """
        start = time.perf_counter()
        errors: list[str | None] = [None] * len(items)

        def run(index: int) -> T | None:
            try:
                return fn(items[index])
            except (RequestFailed, ValueError) as err:
                errors[index] = str(err)
                return None

        workers = min(self.max_concurrency, len(items))
        if workers <= 1:
            results = [run(i) for i in range(len(items))]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remote-reward") as pool:
                results = list(pool.map(run, range(len(items))))

        failed = [e for e in errors if e is not None]
        stats = CallStats(
            items=len(items),
            failures=len(failed),
            latency_s=time.perf_counter() - start,
            last_error=failed[-1] if failed else "",
        )
        with self._lock:
            self.last_stats = stats
            if items and len(failed) == len(items):
                self.consecutive_failures += 1
            else:
                self.consecutive_failures = 0
            streak = self.consecutive_failures
        if failed:
            log.warning(
                "%s: %d/%d requests to %s failed; last: %s",
                self.flag,
                len(failed),
                len(items),
                self.url,
                failed[-1],
            )
        if streak >= self.max_consecutive_failures:
            raise RemoteRewardError(
                f"{self.flag}: endpoint {self.url} failed {streak} consecutive batches (no sample scored); "
                f"last error: {stats.last_error}. Check that the server is up and healthy, or raise "
                f"{self.flag}.max_consecutive_failures / timeout_s"
            )
        return results
