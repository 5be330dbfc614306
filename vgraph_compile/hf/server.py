"""``vgraph serve``: transformers' own OpenAI-compatible server (``transformers serve``, transformers >= 5.23) with
every VLM it loads served by ``compile_vlm``.

The hook is transformers' public ``ModelManager`` (``transformers.cli.serving``): handlers get their models from
its ``load_model_and_processor``, which ``manager_class`` extends. When a model is loaded (at start-up for the
model the command names), its vision tower is replaced by vgraph's and warmed up before the model is handed to any
request: every bucket captured (or loaded from the plans ``vgraph precompile`` saved), then one generated token for a
synthetic image through the server's own processor, so the first request meets no trace, compile or capture. The
processor's images are resized and normalized on the model's GPU where its image processor has transformers'
torchvision backend (``images_on_device``). A model vgraph cannot serve (no vision tower, a tower it refuses, a
warm-up failure) is served stock, its processor as it was, with one warning.

``Serve`` (the ``transformers serve`` command) builds its ``ModelManager`` itself; ``serve`` runs it with the
extended class bound in that name while it builds, and parses the command line with Serve's own options.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
import weakref
from typing import Any

import torch

from vgraph_compile.hf.vlm import find_vision_tower

__all__ = ["hook_point", "manager_class", "serve", "serve_model", "warm_up"]

log = logging.getLogger(__name__)

HOOK_PARAMETERS = ("model_id_and_revision", "progress_callback", "tqdm_class")
"""The parameters of ``ModelManager.load_model_and_processor`` the hook relies on."""


def hook_point() -> tuple[type, type]:
    """``(Serve, ModelManager)`` of the installed transformers, or SystemExit naming its version and what is
    missing: ``Serve`` must build a ``ModelManager`` whose ``load_model_and_processor`` hands out models."""
    import transformers

    try:
        from transformers.cli.serve import Serve
        from transformers.cli.serving import model_manager
    except ImportError as error:
        raise SystemExit(
            f"vgraph serve: transformers {transformers.__version__} has no serving module ({error}); vgraph serve "
            "runs transformers' own server: pip install 'transformers>=5.23'"
        ) from error
    manager = getattr(model_manager, "ModelManager", None)
    loader = getattr(manager, "load_model_and_processor", None)
    missing = []
    if loader is None:
        missing.append("ModelManager.load_model_and_processor")
    elif not set(HOOK_PARAMETERS) <= set(inspect.signature(loader).parameters):
        missing.append(f"load_model_and_processor({', '.join(HOOK_PARAMETERS)})")
    if "ModelManager" not in Serve.__init__.__code__.co_names:
        missing.append("Serve building transformers.cli.serving.model_manager.ModelManager")
    if missing:
        raise SystemExit(
            f"vgraph serve: transformers {transformers.__version__} changed the hook point vgraph serve loads models "
            f"through: no {'; no '.join(missing)}. vgraph serve supports transformers 5.23-5.24"
        )
    return Serve, manager


def _synthetic_request() -> list[dict]:
    """One user turn: a seeded 224 x 224 noise image and a word."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(224, 224, 3), dtype=np.uint8)
    content = [{"type": "image", "image": Image.fromarray(pixels)}, {"type": "text", "text": "."}]
    return [{"role": "user", "content": content}]


def warm_up(model: torch.nn.Module, processor) -> None:
    """Capture every bucket of the model's vgraph tower (a packed tower's ``warmup``), then generate one token for a
    synthetic image through ``processor``, as a request would (a fixed-tile tower traces here), under ``no_grad``
    as transformers' ``generate`` runs; returns once every graph is captured (``capture_all``)."""
    from tqdm.auto import tqdm

    owner, attribute = find_vision_tower(model)
    tower = getattr(owner, attribute)
    with tqdm(total=2, desc="vgraph: warming up", unit="step") as bar, torch.no_grad():
        if hasattr(tower, "warmup"):
            tower.warmup()
        bar.update()
        inputs = processor.apply_chat_template(
            _synthetic_request(), add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt",
        ).to(model.device)  # fmt: skip
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        if hasattr(tower, "capture_all"):
            tower.capture_all()
        bar.update()


def _serve_stock(model: torch.nn.Module) -> None:
    """Put the stock tower back where ``compile_vlm`` put vgraph's (nothing when no tower was found)."""
    with contextlib.suppress(ValueError):
        owner, attribute = find_vision_tower(model)
        tower = getattr(owner, attribute)
        setattr(owner, attribute, getattr(tower, "tower", tower))


def images_on_device(processor, device: torch.device) -> bool:
    """Make ``processor``'s image processor resize and normalize the images on ``device``, a CUDA device: the
    torchvision backend of transformers' image processors takes a ``device`` (``ImagesKwargs``) whose default is the
    image processor's attribute of that name, and returns its pixels there (the PIL backend works on the host and
    is left as it is). True where it was set."""
    try:
        from transformers.image_processing_backends import TorchvisionBackend
    except ImportError:  # a transformers without the torchvision backend
        return False
    image_processor = getattr(processor, "image_processor", None)
    if device.type != "cuda" or not isinstance(image_processor, TorchvisionBackend):
        return False
    image_processor.device = device
    return True


def serve_model(model: torch.nn.Module, processor, options: dict[str, Any]) -> bool:
    """Serve ``model``'s vision tower with ``compile_vlm(model, **options)``, its images processed on the model's
    GPU (``images_on_device``), and warm both up; True when served. Whatever fails leaves the model and its
    processor stock, with one warning giving the reason."""
    from vgraph_compile.hf import compile_vlm

    name = type(model).__name__
    start = time.perf_counter()
    image_processor = getattr(processor, "image_processor", None)
    device_before = getattr(image_processor, "device", None)
    try:
        compile_vlm(model, **options)
        if images_on_device(processor, model.device):
            log.info("vgraph serve: %s images are resized and normalized on %s", name, model.device)
        warm_up(model, processor)
    except Exception as error:  # any model vgraph cannot serve is served as it is
        _serve_stock(model)
        if image_processor is not None:
            image_processor.device = device_before
        log.warning("vgraph serve: %s is served stock: %s", name, error)
        log.debug("vgraph serve: %s", name, exc_info=True)
        return False
    log.info("vgraph serve: %s vision tower served by vgraph (warm-up %.1f s)", name, time.perf_counter() - start)
    return True


def manager_class(options: dict[str, Any], started: float | None = None) -> type:
    """transformers' ``ModelManager`` extended to serve every VLM it loads with ``compile_vlm(model, **options)``
    (see the module docstring); ``started``: when the command started (``time.perf_counter``), which the logged
    start-up time counts from (default: now)."""
    _, manager = hook_point()

    class VGraphModelManager(manager):
        vgraph_options = dict(options)
        """``compile_vlm`` options for every model."""
        vgraph_started = time.perf_counter() if started is None else started

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._vgraph_lock = threading.Lock()
            self._vgraph_seen: weakref.WeakSet = weakref.WeakSet()
            self.vgraph_served: dict[str, bool] = {}
            """Whether vgraph serves each loaded model's tower, by the name it was loaded under."""
            super().__init__(*args, **kwargs)

        def load_model_and_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any):
            load_start = time.perf_counter()
            model, processor = super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
            with self._vgraph_lock:
                if model not in self._vgraph_seen:
                    loaded = time.perf_counter()
                    served = serve_model(model, processor, self.vgraph_options)
                    self._vgraph_seen.add(model)
                    self.vgraph_served[model_id_and_revision] = served
                    now = time.perf_counter()
                    log.info(
                        "vgraph serve: %s ready, start-up %.1f s (loading %.1f s, vgraph %.1f s)",
                        model_id_and_revision, now - self.vgraph_started, loaded - load_start, now - loaded,
                    )  # fmt: skip
            return model, processor

        def shutdown(self) -> None:
            """Log the bucket stats of every tower vgraph serves, then unload as transformers does."""
            for name, timed in list(self.loaded_models.items()):
                if timed.model is None:
                    continue
                with contextlib.suppress(ValueError):
                    owner, attribute = find_vision_tower(timed.model)
                    tower = getattr(owner, attribute)
                    if hasattr(tower, "stats_table"):
                        log.info("vgraph serve: %s vision tower buckets:\n%s", name, tower.stats_table())
            super().shutdown()

    return VGraphModelManager


@contextlib.contextmanager
def _bound(module, name: str, value: Any):
    previous = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, previous)


def serve(arguments: list[str], manager: type) -> Any:
    """Run ``transformers serve`` with ``arguments`` (its own command line: the model directory first, then its
    options) and ``manager`` (``manager_class(options)``, or any ``ModelManager`` subclass) loading its models;
    returns the ``Serve`` object when it stops (at once with ``--non-blocking``)."""
    import typer
    from transformers.cli.serving import model_manager

    serve_class, _ = hook_point()
    app = typer.Typer(add_completion=False)
    app.command()(serve_class)
    command = typer.main.get_command(app)
    with _bound(model_manager, "ModelManager", manager):
        return command.main(args=arguments, prog_name="vgraph serve", standalone_mode=False)
