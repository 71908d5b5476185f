"""`eqx-gpt serve --checkpoint RUN --follow`: a run's newest checkpoint served as it lands.

A `RunFollower` polls the run folder every `every_s` seconds for its newest checkpoint
(`newest_checkpoint`: `latest` or `best`, whichever has the higher step). A run writes each
checkpoint atomically, the JSON last and naming a complete weights file by its sha256
(`eqx_gpt.checkpoint`), so a JSON read is always whole; when it names other weights than those
served, they are loaded in the follower's thread and handed to `on_load`, which swaps them in (the
server's `swap`: the batcher takes them between two decode steps). A checkpoint replaced while it
is read (its weights file gone) is tried again at the next poll.

Requests in flight are not dropped: as with vLLM's in-place weight updates, from the next step on
every slot decodes with the new weights, a request in flight keeping the keys and values its
earlier tokens left in the cache; requests admitted later run on the new weights alone.

A checkpoint of another model (other shapes, another tokenizer: a new run in the same folder) is
not swapped in; the server goes on with what it has and `error` says why, as does `/v1/run`.
"""

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from eqx_gpt.checkpoint import BEST, LATEST, checkpoint_file, read_metadata
from eqx_gpt.errors import EqxGptError

FOLLOW_EVERY_S = 1.0  # how often the run folder is looked at


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The metadata file of the run's newest checkpoint (the higher step; `latest` on a tie), or
    None when the folder holds none that reads."""
    found = []
    for name in (LATEST, BEST):
        path = checkpoint_file(run_dir, name)
        if path.is_file():
            try:
                found.append((read_metadata(path)["step"], name == LATEST, path))
            except EqxGptError:
                continue  # being replaced, or not a checkpoint: the next poll sees
    return max(found)[2] if found else None


def _shapes(model) -> tuple:
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, structure = jax.tree.flatten(arrays)
    return structure, static, [(a.shape, a.dtype) for a in leaves]


def same_model(served, loaded) -> bool:
    """Whether `loaded` has `served`'s structure and array shapes (so it swaps in with no recompile)."""
    try:
        return _shapes(served) == _shapes(loaded)
    except Exception:  # a static part that cannot be compared is another model
        return False


class RunFollower:
    """Polls `run_dir` in a thread for checkpoints newer than `sha256` (the weights served) and
    hands each to `on_load(model, meta)`. `load(path)` reads one (`load_model`'s answer);
    `served()` gives the model served now, which a new one must match (`same_model`), and
    `tokenizer` is the one it must have."""

    def __init__(
        self, run_dir: Path, *, sha256: str | None, load: Callable[[Path], tuple[Any, Any, dict]],
        served: Callable[[], Any], tokenizer, on_load: Callable[[Any, dict], None],
        every_s: float = FOLLOW_EVERY_S,
    ):  # fmt: skip
        self.run_dir, self.sha256, self.every_s = Path(run_dir), sha256, every_s
        self._load, self._served, self._on_load = load, served, on_load
        self._tokenizer = tokenizer.to_dict()
        self.loaded = 0  # checkpoints swapped in
        self.error: str | None = None  # why the newest checkpoint is not served (None: it is)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="eqx_gpt-follow", daemon=True)

    def start(self) -> "RunFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception as e:  # the server goes on with the model it has
                self.error = f"the run's newest checkpoint could not be loaded: {type(e).__name__}: {e}"

    def check(self) -> bool:
        """Look once: swap in the newest checkpoint if it is new; whether one was swapped in."""
        path = newest_checkpoint(self.run_dir)
        if path is None:
            return False
        try:
            meta = read_metadata(path)
            if meta["sha256"] == self.sha256:
                return False
            model, tokenizer, meta = self._load(path)
        except EqxGptError:
            return False  # replaced while read: its weights file is gone; the next poll reads the new one
        if not same_model(self._served(), model) or getattr(tokenizer, "to_dict", dict)() != self._tokenizer:
            self.error = (
                f"{path} (step {meta['step']}) holds another model or tokenizer than the one served; "
                f"restart the server to serve it"
            )
            self.sha256 = meta["sha256"]  # not tried again until it changes
            return False
        self._on_load(model, meta)
        self.sha256, self.error = meta["sha256"], None
        self.loaded += 1
        return True
