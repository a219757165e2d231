"""Tracking a run with Weights & Biases (--track): what can be checked before the model loads, the
start of the wandb run within a timeout, and the metrics rows and pictures sent to it. wandb is
imported only here, and only when --track asks for it."""

from __future__ import annotations

import os
import shutil
import time

from common.plumbing.checks import ConfigError

# How long wandb.init may take to start the run before the run stops in one line (wandb's own
# default is 90 s, and with a key but no network it hung past that); WANDB_INIT_TIMEOUT overrides
# it. wandb's identity lookups come on top (5 s each when the server does not answer them); a
# server nothing answers at is refused before the model loads (check_reachable).
WANDB_INIT_TIMEOUT_S = 30.0


def check_tracking(args) -> None:
    """--track: what can be known before any model loads, in one line: wandb installed, a project
    name wandb takes, and (online) an API key wandb will find and a server this machine can reach.
    What cannot be known here (the key's validity, a server that accepts and never answers) is
    bounded by RunLogger's timeout."""
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
            f"--track: wandb's credentials are unusable ({' '.join(str(e).split())[:160]}): fix "
            "WANDB_API_KEY (or `wandb login`), or log offline with WANDB_MODE=offline"
        ) from None
    if auth is None:
        raise ConfigError(
            f"--track logs online to {settings.base_url}, and no wandb API key is set: export "
            "WANDB_API_KEY (or run `wandb login`), or log offline with WANDB_MODE=offline (then "
            "`wandb sync`), or drop --track"
        )
    check_reachable(
        settings.base_url,
        getattr(settings, "https_proxy", None) or getattr(settings, "http_proxy", None),
    )


# How long the --track check waits for a TCP connection to the wandb server. Without one, wandb
# spends 5 s on each of its two identity lookups and then WANDB_INIT_TIMEOUT on the run, after
# the model has loaded (measured 2026-12-05, wandb 0.31: 12.5 s with WANDB_INIT_TIMEOUT=2).
REACH_TIMEOUT_S = 5.0


def check_reachable(url: str, proxy: str | None) -> None:
    """One line before the model loads when nothing answers at the wandb server's address (no
    network, no DNS, a wrong WANDB_BASE_URL). Behind a proxy wandb connects through it, and the
    proxy is what would have to be probed: the check is left to wandb.init then."""
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
            f"{' '.join(str(e).split())[:120]}): check the network (or WANDB_BASE_URL), or log "
            "offline with WANDB_MODE=offline (then `wandb sync`), or drop --track"
        ) from None


def start_wandb(run_dir: str, config: dict, project: str, entity, name: str, new: list[str]):
    """The wandb run, started within WANDB_INIT_TIMEOUT seconds, or one line (ConfigError) after
    removing `new` (the files this run wrote so far: a run that failed here leaves nothing)."""
    import wandb  # lazy: only runs that ask for wandb pay for it (WANDB_MODE=offline works)

    timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", WANDB_INIT_TIMEOUT_S))
    start = time.monotonic()
    try:
        return wandb.init(
            project=project,
            entity=entity,
            name=name,
            config=config,
            dir=run_dir,
            settings=wandb.Settings(init_timeout=timeout),
        )
    except Exception as e:  # noqa: BLE001 - no network, a refused key, a timeout: one line
        for path in new:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        first = " ".join(str(e).split())[:200] or e.__class__.__name__
        raise ConfigError(
            f"--track: wandb did not start in {time.monotonic() - start:.0f} s "
            f"({e.__class__.__name__}: {first}; the run's start may take WANDB_INIT_TIMEOUT="
            f"{timeout:g} s): check the network and the API key, or "
            "log offline with WANDB_MODE=offline (then `wandb sync`), or drop --track"
        ) from None


def to_wandb(run, metrics: dict, images: dict) -> None:
    """A metrics row to the wandb run, with its pictures: an image, or a list of (image, caption)
    pairs (wandb shows them as one captioned gallery)."""
    import wandb

    extra = {
        k: [wandb.Image(im, caption=c) for im, c in v] if isinstance(v, list) else wandb.Image(v)
        for k, v in images.items()
    }
    run.log({**metrics, **extra}, step=metrics["iteration"])
