"""The local web UI: queue training jobs, watch them live (loss, lr, d*lr, samples, memory), stop and
resume them; the memory planner, the dataset view and the LoRA tools as forms.

    python tools/webui.py                                  # http://127.0.0.1:7860
    python tools/webui.py --root /data/models --root /data/datasets
    python tools/webui.py --host 0.0.0.0 --password SECRET # another address needs a password

Jobs are kept in --jobs_dir (a SQLite queue and one folder per job) and run one at a time per
--device as `train_lora.py` processes, with paths relative to the repository (as on the command line).
The pages read and write files only under configs, tiny_models, learned, out, the jobs folder and the
--root folders. A job left running when the UI stops goes on; the next start re-attaches to it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sqlite3
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.errors import exit_without_collecting  # noqa: E402
from tools.cli import Parser  # noqa: E402

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def build_parser() -> argparse.ArgumentParser:
    summary = __doc__.split("\n\n")[0].replace("\n", " ")  # the first paragraph, whole
    p = Parser(description=summary)
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (another than 127.0.0.1 needs --password)")
    p.add_argument("--port", type=int, default=7860, help="the port to serve on (1-65535)")
    p.add_argument("--user", default="admin", help="the user name with --password")
    p.add_argument("--password", default=os.environ.get("LORA_WEBUI_PASSWORD"),
                   help="require this password (also LORA_WEBUI_PASSWORD)")
    p.add_argument("--jobs_dir", default=None,
                   help="the queue's database and the jobs' output folders (default: runs/webui in the repository)")
    p.add_argument("--root", action="append", default=None,
                   help="a folder the pages may read files from and write to, besides configs, tiny_models, "
                        "learned, out and the jobs folder (repeatable)")
    p.add_argument("--device", action="append", default=None,
                   help="a device to run jobs on, one job at a time each (cpu, cuda:0, cuda:1, ...; default one)")
    return p


def start_up_problem(args, jobs_dir: str, roots: list[str]) -> str | None:
    """What stops the UI from starting, in one line (None: nothing), before anything is made."""
    if args.host not in LOCAL_HOSTS and not args.password:
        return (f"--host {args.host} serves the UI to other machines: give --password (or LORA_WEBUI_PASSWORD); "
                f"anyone who reaches it can start processes and read files under the roots")
    if not 1 <= args.port <= 65535:
        return f"--port {args.port}: a port is 1 to 65535"
    named = {}  # a worker per entry: one named twice ran two jobs on it at once (cuda is cuda:0, cuda:00 too)
    for device in args.device or []:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            return f"--device {device}: expected cpu, cuda or cuda:N (N the GPU's index)"
        same = "cpu" if device == "cpu" else f"cuda:{int(device.partition(':')[2] or 0)}"
        if same in named:
            also = "" if named[same] == device else f" (as {named[same]}: both are {same})"
            return f"--device {device}: given twice{also} (each device runs one job at a time: name it once)"
        named[same] = device
    if os.path.exists(jobs_dir) and not os.path.isdir(jobs_dir):
        return f"--jobs_dir {jobs_dir}: not a folder (the queue's database and the jobs' folders go there)"
    for root in roots:
        if not os.path.isdir(root):
            return f"--root {root}: no such folder"
    return port_in_use(args.host, args.port)


def port_in_use(host: str, port: int) -> str | None:
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # As uvicorn binds: a stopped UI's closed connections (TIME_WAIT) leave the port free to
            # serve; a port another server listens on is still refused.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return f"--port {port}: cannot serve on {host}:{port} ({e.strerror}; another UI?): pick another --port"
    return None


def own_gradio_cache(jobs_dir: str) -> str | None:
    """gradio's cache of the images it served (GRADIO_TEMP_DIR; unset: a folder in the UI's jobs folder, returned,
    emptied here and at the UI's stop: the UI holding that folder's lock is its only user). gradio's own shutdown
    left its copies of the galleries' images behind (in /tmp), one per image viewed, as long as the UI ran."""
    if os.environ.get("GRADIO_TEMP_DIR"):  # the user's own: shared perhaps, never emptied here
        return None
    # hidden: the pages' file pickers pass over dot folders (its copies would crowd the jobs folder's images out)
    cache = os.environ["GRADIO_TEMP_DIR"] = os.path.join(jobs_dir, ".gradio_cache")
    shutil.rmtree(cache, ignore_errors=True)
    return cache


def stop_serving(signum, frame):
    """SIGTERM (systemd, docker stop, kill) as Ctrl-C: gradio closes its server, the UI its config checker and
    gradio's cache (own_gradio_cache). Python's default ended the process where it stood, leaving them. Training
    jobs run on (a new UI takes them up)."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:  # a bad flag (Parser's): one line, as every tool's
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Folders given on the command line are the caller's; the defaults are the repository's, where
    # jobs run (a config's relative paths mean there what they mean to train_lora.py run from it).
    jobs_dir = os.path.abspath(args.jobs_dir) if args.jobs_dir else os.path.join(ROOT, "runs", "webui")
    # --root adds to the repository's folders (it replaced them: the shipped configs and their prompt files could
    # not be opened, while the help and the refusals said "add")
    given = [os.path.abspath(r) for r in args.root or []]
    roots = [os.path.join(ROOT, r) for r in ("configs", "tiny_models", "learned", "out")] + given
    if problem := start_up_problem(args, jobs_dir, given):  # default roots may not exist yet
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.chdir(ROOT)
    from library.ui.handlers import WebUI

    try:
        ui = WebUI(jobs_dir, ROOT, roots, tuple(args.device or ["default"]))
    except OSError as e:  # e.g. a jobs folder it may not write
        print(f"error: --jobs_dir {jobs_dir}: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except sqlite3.Error as e:  # no OSError: e.g. a jobs folder it may not write, or a jobs.sqlite that is no database
        print(f"error: --jobs_dir {jobs_dir}: {e}: {os.path.join(jobs_dir, 'jobs.sqlite')}", file=sys.stderr)
        return 2
    if holder := ui.store.hold():
        print(f"error: --jobs_dir {jobs_dir}: {holder} serves this queue: use that one, stop it, or give another "
              f"--jobs_dir", file=sys.stderr)
        return 2
    cache = own_gradio_cache(jobs_dir)  # read as gradio is imported
    from library.ui.app import CSS, build_app  # gradio: seconds to import, after the checks that refuse a start

    ui.start()
    app = build_app(ui)
    auth = (args.user, args.password) if args.password else None
    print(f"lora trainer UI on http://{args.host}:{args.port}" + (" (password required)" if auth else ""), flush=True)
    signal.signal(signal.SIGTERM, stop_serving)
    try:
        app.launch(server_name=args.host, server_port=args.port, auth=auth, allowed_paths=ui.roots.roots,
                   show_error=True, quiet=True, footer_links=["api"], css=CSS)
    except OSError:  # taken between the check above and now
        print(f"error: --port {args.port}: cannot serve on {args.host}:{args.port}: pick another --port", file=sys.stderr)
        return 2
    finally:
        ui.close()
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
