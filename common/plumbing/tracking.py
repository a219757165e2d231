"""Weights & Biases (--track): the checks before the model loads, the run's bounded start, and the
rows and pictures sent to it. wandb is imported only here, and only when --track asks for it."""

from __future__ import annotations

import os
import shutil
import time

from common.plumbing.checks import ConfigError

# How long wandb.init may take to start the run (WANDB_INIT_TIMEOUT overrides it; wandb's own 90 s
# default hung past that with a key and no network), and how long check_reachable waits for a TCP
# connection: without one, wandb spent 5 s on each of two identity lookups, then the init timeout.
WANDB_INIT_TIMEOUT_S = 30.0
REACH_TIMEOUT_S = 5.0
OFFLINE = "log offline with WANDB_MODE=offline"
OR_OFFLINE = f"{OFFLINE} (then `wandb sync`), or drop --track"  # how most --track lines end


def _one_line(e: BaseException, n: int) -> str:
    return " ".join(str(e).split())[:n]


def check_tracking(args) -> None:
    """--track, before any model loads: wandb, a project name it takes and, online, an API key and a
    server this machine reaches (the rest is bounded by start_wandb's timeout)."""
    if not args.track:
        return
    project = args.wandb_project_name
    bad = sorted(set("/\\#?%:") & set(project)) + [c for c in project if not c.isprintable()]
    if not project.strip() or len(project) > 128 or bad:
        raise ConfigError(
            f"--wandb-project-name {project[:80]!r}: wandb takes 1 to 128 printable characters "
            "without / \\ # ? % :; pass another name"
        )
    try:
        from wandb.sdk import wandb_setup
    except ImportError:
        raise ConfigError(
            "--track needs wandb: pip install -r requirements.txt, or drop --track"
        ) from None
    settings = wandb_setup.singleton().settings  # reads WANDB_* from the environment
    if settings.mode in ("offline", "dryrun", "disabled"):
        return
    try:
        from wandb.sdk.lib.wbauth import authenticate, host_url

        host = host_url.HostUrl(settings.base_url, app_url=settings.app_url)
        auth = authenticate._use_system_auth(host=host, source="--track", update_session=False)
    except (ImportError, AttributeError, TypeError):
        return  # another wandb release: its own login is checked by wandb.init (bounded)
    except Exception as e:  # noqa: BLE001 - wandb's AuthenticationError: a malformed key
        raise ConfigError(
            f"--track: wandb's credentials are unusable ({_one_line(e, 160)}): fix "
            f"WANDB_API_KEY (or `wandb login`), or {OFFLINE}"
        ) from None
    if auth is None:
        raise ConfigError(
            f"--track logs online to {settings.base_url}, and no wandb API key is set: export "
            f"WANDB_API_KEY (or run `wandb login`), or {OR_OFFLINE}"
        )
    proxy = getattr(settings, "https_proxy", None) or getattr(settings, "http_proxy", None)
    check_reachable(settings.base_url, proxy)


def check_reachable(url: str, proxy: str | None) -> None:
    """One line when nothing answers at the wandb server's address (no network, no DNS, a wrong
    WANDB_BASE_URL). Behind a proxy, the proxy would have to be probed: left to wandb.init."""
    import socket
    from urllib.parse import urlsplit

    names = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
    if proxy or any(os.environ.get(n) or os.environ.get(n.lower()) for n in names):
        return
    where = urlsplit(url)
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        socket.create_connection((where.hostname, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(
            f"--track logs online to {url}, and this machine cannot reach it ({e.__class__.__name__}: "
            f"{_one_line(e, 120)}): check the network (or WANDB_BASE_URL), or {OR_OFFLINE}"
        ) from None


def start_wandb(run_dir: str, config: dict, project: str, entity, name: str, new: list[str]):
    """The wandb run, started within WANDB_INIT_TIMEOUT seconds, or one line (ConfigError) after
    removing `new` (the files this run wrote so far: a run that failed here leaves nothing)."""
    import wandb

    timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", WANDB_INIT_TIMEOUT_S))
    start = time.monotonic()
    try:
        settings = wandb.Settings(init_timeout=timeout)
        return wandb.init(
            project=project, entity=entity, name=name, config=config, dir=run_dir, settings=settings
        )
    except Exception as e:  # noqa: BLE001 - no network, a refused key, a timeout: one line
        for path in new:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        raise ConfigError(
            f"--track: wandb did not start in {time.monotonic() - start:.0f} s "
            f"({e.__class__.__name__}: {_one_line(e, 200) or e.__class__.__name__}; the run's "
            f"start may take WANDB_INIT_TIMEOUT={timeout:g} s): check the network and the API "
            f"key, or {OR_OFFLINE}"
        ) from None


def to_wandb(run, metrics: dict, images: dict) -> None:
    """A metrics row with its pictures: an image, or (image, caption) pairs (a gallery)."""
    import wandb

    extra = {
        k: [wandb.Image(im, caption=c) for im, c in v] if isinstance(v, list) else wandb.Image(v)
        for k, v in images.items()
    }
    run.log({**metrics, **extra}, step=metrics["iteration"])
