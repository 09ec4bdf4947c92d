"""The course as a learner meets it in JupyterLab, in a real browser: what only a browser can check.

nbval already runs every notebook's kernel; this test runs no lesson's kernel. One JupyterLab server
(root = the repository; the settings `make lab` passes, everything else of Jupyter's in a temporary
directory) and one headless Chromium (the Debian package, driven by Playwright for Python with a
fresh profile; never a browser Playwright downloads) check three things:

1. opening: every notebook under notebooks/ opens and renders its stored outputs, every one of them;
   none reads as a widget's repr (VBox(children=...)), none is an error (unless its cell is tagged
   raises-exception), none says "Error displaying widget";
2. the views: tests/browser/widgets.ipynb builds every ipywidgets view the course uses on small
   inputs and is Run All'd; every control of every view is moved (a slider one step, a dropdown to
   another option, a checkbox, toggle buttons, a play button), the view must change (its text less
   the controls, and the bytes of its pictures) and follow the control back; a control of a kind
   this test cannot move is reported;
3. reopening: the harness is then saved, closed and opened again with its kernel running (the views
   come back live), then closed, its kernel shut down, and opened again as on a learner's next day:
   every view comes back from the widget state saved with it; none says "Error displaying widget:
   model not found".

A self-test notebook (a widget's repr, a view saved without its widget state, an error, a dead
widget) runs beside them: the run must report exactly what is wrong with it.
`test_every_course_view_is_in_the_harness` (no browser) fails when a notebook calls a view the
harness does not build. Screenshots go to $MINIKV_SCREENSHOTS (default .pytest_cache/browser/) with
times.txt. `-k 05_` opens one notebook. Without Chromium or Playwright the browser tests skip and
say why; MINIKV_CHROMIUM names the browser (empty: skip).
"""
from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
HARNESS = ROOT / "tests" / "browser" / "widgets.ipynb"
WORK = ROOT / ".pytest_cache" / "minikv-browser"  # hidden and ignored by git: the copies this test saves
RUN_TIMEOUT = float(os.environ.get("MINIKV_BROWSER_TIMEOUT", 240))  # Run All of the harness
OPEN_TIMEOUT = 60.0  # seconds for a notebook to open and render its outputs
VIEW_TIMEOUT = 60.0  # seconds for a widget's view to answer a moved control
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# As root Chromium needs --no-sandbox; on a closed network the background services (component
# updates, sync, QUIC) open connections that are refused many at a time: keep them all off.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]

# notebooks whose failure here is a known, open bug (name -> reason); empty when the course is sound
KNOWN_BROKEN: dict[str, str] = {}


def find_chromium() -> str | None:
    """The Chromium to drive: $MINIKV_CHROMIUM when set (empty disables), else chromium on PATH."""
    if "MINIKV_CHROMIUM" in os.environ:
        return os.environ["MINIKV_CHROMIUM"] or None
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    return None


def unavailable_reason() -> str | None:
    """Why the real-browser test cannot run here, or None when it can."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError as e:
        return f"Playwright for Python is missing ({e}): pip install playwright (never `playwright install`)"
    if find_chromium() is None:
        return ("Chromium is not installed (apt-get install chromium, or set MINIKV_CHROMIUM to its path): "
                "the real-browser test of the notebooks is skipped")
    return None


# ---------------------------------------------------------------------------------------------
# `make lab` as the Makefile spells it


def make_lab_command() -> tuple[dict[str, str], list[str]]:
    """The environment assignments and the arguments of the `jupyter lab` line `make lab` runs."""
    dry = subprocess.run(["make", "-n", "-s", "lab"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    script = dry.stdout.replace("\\\n", " ")
    line = next((ln for ln in script.splitlines() if "jupyter lab" in ln), None)
    assert line, f"`make -n lab` runs no `jupyter lab`:\n{dry.stdout}{dry.stderr}"
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words[:words.index(next(w for w in words if w.endswith("jupyter")))])
    return env, words[len(env):]


def lab_settings_dir() -> Path:
    """The folder `make lab` passes as --LabApp.app_settings_dir (its overrides.json)."""
    _, args = make_lab_command()
    found = [a.split("=", 1)[1] for a in args if a.startswith("--LabApp.app_settings_dir=")]
    assert found, f"`make lab` passes no --LabApp.app_settings_dir: {args}"
    return Path(found[0])


# ---------------------------------------------------------------------------------------------
# the JupyterLab server


@dataclass
class Lab:
    url: str
    token: str
    log: Path
    proc: subprocess.Popen

    def api(self, method: str, path: str):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shut_down(self, rel: str) -> None:
        """Shut the kernel of notebook `rel` down (its session deleted), as closing JupyterLab does."""
        for s in self.api("GET", "/api/sessions"):
            if s.get("path") == rel or s.get("notebook", {}).get("path") == rel:
                self.api("DELETE", f"/api/sessions/{s['id']}")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_with_parent() -> None:
    """(In the child, before exec.) On Linux, SIGTERM when the test process dies, even killed: the
    server then shuts its kernels down instead of outliving the run."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_lab(tmp: Path) -> Lab:
    """JupyterLab on a free port, root = the repository, `make lab`'s settings, every user folder under `tmp`."""
    env = dict(os.environ)
    from minikv.model.named import cache_dir

    env["MINIKV_CACHE"] = str(cache_dir())  # the prepared model, found before HOME moves
    dirs = {"HOME": "home", "JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data",
            "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTERLAB_SETTINGS_DIR": "settings",
            "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "IPYTHONDIR": "ipython", "MPLCONFIGDIR": "mpl"}
    for var, name in dirs.items():
        (tmp / name).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp / name)
    make_env, make_args = make_lab_command()
    for var, value in make_env.items():  # OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}, as the shell reads it
        env[var] = os.path.expandvars(re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1]) or m[2], value))
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTER_PREFER_ENV_PATH", None)
    # the user's own settings on top of `make lab`'s: no autosave (only the saves this test makes), every
    # cell attached to the page (the check reads every output), no news or update checks
    user = {"@jupyterlab/docmanager-extension/plugin": {"autosave": False},
            "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"}}
    for plugin, values in user.items():
        folder = tmp / "settings" / plugin.rsplit("/", 1)[0]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{plugin.rsplit('/', 1)[1]}.jupyterlab-settings").write_text(json.dumps(values))
    (tmp / "config" / "labconfig").mkdir()
    (tmp / "config" / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    token = secrets.token_hex(16)
    port = free_port()
    jupyter = Path(sys.executable).with_name("jupyter")
    cmd = [str(jupyter), "lab"] if jupyter.exists() else [sys.executable, "-m", "jupyterlab"]
    cmd += [a for a in make_args if a.startswith("--LabApp.app_settings_dir=")]
    cmd += ["--no-browser", f"--port={port}", "--ip=127.0.0.1", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
            "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--ServerApp.jpserver_extensions=jupyter_lsp=False",
            "--ContentsManager.allow_hidden=True"]  # the harness and self-test copies live in .pytest_cache
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = tmp / "jupyter.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=stop_with_parent)
    lab = Lab(f"http://127.0.0.1:{port}", token, log, proc)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited ({proc.returncode}):\n{lab.log_tail()}")
        try:
            lab.api("GET", "/api/status")
            return lab
        except OSError as e:
            if time.monotonic() > deadline:
                stop_lab(lab)
                raise RuntimeError(f"JupyterLab did not answer in 90 s:\n{lab.log_tail()}") from e
            time.sleep(0.5)


def stop_lab(lab: Lab) -> None:
    lab.proc.terminate()
    try:
        lab.proc.wait(20)
    except subprocess.TimeoutExpired:
        lab.proc.kill()
        lab.proc.wait()


# ---------------------------------------------------------------------------------------------
# a notebook in the page

# The notebook's state as JupyterLab holds it (window.jupyterapp: expose_app_in_browser): per code cell
# its outputs in the model, and what the page shows of them.
STATE_JS = """(path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  let panel = null;
  for (const w of app.shell.widgets('main')) if (w.context && w.context.path === path) panel = w;
  if (!panel || !panel.context.isReady) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = [];
  panel.content.widgets.forEach((cell, index) => {
    const m = cell.model;
    if (m.type !== 'code') return;
    const source = m.sharedModel.getSource();
    const errors = [];
    let widgets = 0;
    for (let i = 0; i < m.outputs.length; i++) {  // (no toJSON of every picture, once a second)
      const o = m.outputs.get(i);
      if (o.type === 'error') { const e = o.toJSON(); errors.push(`${e.ename}: ${e.evalue}`); }
      if (o.data && o.data['application/vnd.jupyter.widget-view+json']) widgets += 1;
    }
    const shown = Array.from(cell.node.querySelectorAll('.jp-OutputArea-output'));
    const texts = shown.map(n => n.textContent);
    cells.push({
      index: index + 1, count: m.executionCount, source: source.slice(0, 300), empty: source.trim() === '',
      pending: ((cell.promptNode && cell.promptNode.textContent) || '').includes('*'),
      tags: m.getMetadata('tags') || [], errors, widgets, outputs: m.outputs.length, shown: shown.length, texts,
      views: shown.filter((n, i) => n.querySelector('.widget-box') && !texts[i].includes('Error displaying')).length,
    });
  });
  return {kernel: kernel ? kernel.status : 'none', dirty: panel.context.model.dirty, cells};
}"""
OPEN_JS = """async (path) => {
  const panel = await window.jupyterapp.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await panel.context.ready;
  return true;
}"""
SAVE_AND_CLOSE_JS = """async (path) => {
  for (const w of window.jupyterapp.shell.widgets('main')) {
    if (w.context && w.context.path === path) { await w.context.save(); w.dispose(); return true; }
  }
  return false;
}"""
# In the page that only opens notebooks, JupyterLab starts no kernel for them (as "No Kernel"): the
# outputs shown are the stored ones, and nbval runs the kernels.
NO_KERNEL_JS = """() => {
  const factory = window.jupyterapp.docRegistry.getWidgetFactory('Notebook');
  Object.defineProperty(factory, 'preferKernel', {value: false});
}"""
CLOSE_JS = """(path) => {
  for (const w of window.jupyterapp.shell.widgets('main')) if (w.context && w.context.path === path) w.dispose();
}"""

# The controls a learner moves, and how to find them inside a widget view.
CONTROLS = {
    "slider": ".widget-slider .noUi-handle",
    "dropdown": ".widget-dropdown select",
    "checkbox": ".widget-checkbox input[type=checkbox]",
    "toggle": "button.widget-toggle-button:not(.widget-toggle-buttons button)",
    "toggles": ".widget-toggle-buttons",
    "play": ".widget-play",
    "radio": ".widget-radio-box",
}
# Anything a learner can operate that no CONTROLS selector covers (a new kind of control): reported.
UNMOVABLE_JS = """(el) => Array.from(el.querySelectorAll('input, select, button, textarea, .noUi-handle'))
  .filter(n => !n.closest('.widget-slider, .widget-dropdown, .widget-checkbox, .widget-toggle-button, '
                          + '.widget-toggle-buttons, .widget-play, .widget-radio-box'))
  .map(n => n.tagName.toLowerCase()
            + (n.closest('.jupyter-widgets') ? ' in ' + n.closest('.jupyter-widgets').className : ''))"""
# What is left of a view once its controls (and their readouts) are taken out: its text and the
# bytes of its pictures (a hash), which must change when a control moves.
VIEW_JS = """async (el) => {
  const clone = el.cloneNode(true);
  clone.querySelectorAll('.widget-slider, .widget-dropdown, .widget-checkbox, .widget-toggle-button, '
    + '.widget-toggle-buttons, .widget-play, .widget-radio, .widget-radio-box, .widget-readout, '
    + '.widget-inline-hbox > .widget-label').forEach(n => n.remove());
  const digest = async (buf) => {
    const h = await crypto.subtle.digest('SHA-256', buf);
    return Array.from(new Uint8Array(h)).map(b => b.toString(16).padStart(2, '0')).join('').slice(0, 16);
  };
  const pictures = [];
  for (const img of el.querySelectorAll('img')) {
    if (!img.src) { pictures.push('(none)'); continue; }
    const buf = await (await fetch(img.src)).arrayBuffer();
    pictures.push(await digest(buf));
  }
  for (const c of el.querySelectorAll('canvas')) pictures.push(await digest(new TextEncoder().encode(c.toDataURL())));
  return {text: clone.textContent.replace(/\\s+/g, ' ').trim(), pictures};
}"""


# ipywidgets' own repr, what a saved widget shows where no kernel runs it (minikv.viz.view replaces it)
WIDGET_REPR = re.compile(r"\b(?:[A-Z]\w*Box|Tab|Accordion)\(children=|\b(?:Int|Float)\w*Slider\(value=")


@dataclass
class Result:
    name: str
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    moves: list[str] = field(default_factory=list)  # "widget 1 slider: changed"
    screenshots: list[str] = field(default_factory=list)
    shown: int = 0  # outputs shown on opening
    saved_views: int = 0  # views shown again after the notebook was saved, closed and reopened
    phases: dict[str, float] = field(default_factory=dict)  # seconds: "run all", "moves", "reopen"


def first_line(source: str) -> str:
    lines = [ln for ln in source.splitlines() if ln.strip() and not ln.startswith("# NBVAL")]
    return (lines[0] if lines else "").strip()[:80]


async def notebook_state(page, path: str):
    return await page.evaluate(STATE_JS, path)


def shown_problems(state: dict, when: str) -> list[str]:
    """What is wrong with the outputs the page shows: a widget's repr, an error, a widget that failed."""
    problems = []
    for c in state["cells"]:
        where = f"cell {c['index']} ({first_line(c['source'])!r})"
        if c["errors"] and "raises-exception" not in c["tags"]:
            problems.append(f"{when}, {where} shows an error: " + "; ".join(c["errors"]))
        for text in c["texts"]:
            if m := WIDGET_REPR.search(text):
                problems.append(f"{when}, an output reads as a widget's repr: {m.group(0)!r}")
            if "Error displaying" in text:
                problems.append(f"{when}, {where} shows {text.strip()[:80]!r}")
    return problems


async def wait_shown(page, path: str, views: bool = False, timeout: float = OPEN_TIMEOUT) -> dict | None:
    """The notebook's state once every output in its model is in the page (and, with `views`, every
    widget output is a live view or says why not), unchanged for two looks; None after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        state = await notebook_state(page, path)
        done = state is not None and all(
            c["shown"] == c["outputs"] and (not views or c["views"] == c["widgets"]
                                            or any("Error displaying" in t for t in c["texts"]))
            for c in state["cells"])
        if done and state == last:
            return state
        last = state if done else None
        await asyncio.sleep(0.3)
    return None


async def check_opening(page, lab: Lab, nb: Path, result: Result) -> None:
    """Open `nb` in the page's JupyterLab (no kernel starts: NO_KERNEL_JS): every stored output
    shows, and none is a widget's repr, an error or a widget that failed to display."""
    t0 = time.monotonic()
    rel = nb.relative_to(ROOT).as_posix()
    try:
        try:
            await page.evaluate(OPEN_JS, rel)
        except Exception:  # noqa: BLE001 - once more: the file may have been read while being written
            await page.evaluate(CLOSE_JS, rel)
            await page.evaluate(OPEN_JS, rel)
        state = await wait_shown(page, rel)
        if state is None:
            state = await notebook_state(page, rel)
            missing = [f"cell {c['index']} ({c['shown']} of {c['outputs']})"
                       for c in (state or {}).get("cells", []) if c["shown"] != c["outputs"]]
            result.problems.append(f"on opening, outputs not shown in {OPEN_TIMEOUT:.0f} s: {', '.join(missing)}")
        if state is not None:
            result.shown = sum(c["shown"] for c in state["cells"])
            result.problems += shown_problems(state, "on opening")
    except Exception as e:  # noqa: BLE001 - a broken page is this notebook's failure, not the run's
        result.problems.append(f"{type(e).__name__}: {e}")
    finally:
        try:
            await page.evaluate(CLOSE_JS, rel)
            lab.shut_down(rel)
        except Exception:  # noqa: BLE001
            pass
        result.seconds = time.monotonic() - t0


async def wait_run_all(page, path: str, result: Result) -> dict | None:
    """Wait until every queued cell has run and the kernel is idle; None (and a problem) on timeout."""
    deadline = time.monotonic() + RUN_TIMEOUT
    quiet = 0
    while True:
        state = await notebook_state(page, path)
        if state is not None and state["kernel"] == "dead":
            result.problems.append("the kernel died during Run All (out of memory?)")
            return None
        busy = state is None or state["kernel"] != "idle" or any(c["pending"] for c in state["cells"])
        ended = state is not None and (  # (the counts were cleared before the run)
            all(c["count"] is not None or c["empty"] for c in state["cells"])
            or any(c["errors"] and "raises-exception" not in c["tags"] for c in state["cells"]))
        quiet = 0 if busy or not ended else quiet + 1
        if quiet >= 3:  # every cell ran (or one failed), idle with nothing pending, three looks in a row
            return state
        if time.monotonic() > deadline:
            pending = [c for c in (state or {}).get("cells", []) if c["pending"]]
            where = (f"cell {pending[0]['index']} ({first_line(pending[0]['source'])!r}) still running"
                     if pending else f"kernel {state and state['kernel']}")
            result.problems.append(f"Run All did not finish in {RUN_TIMEOUT:.0f} s: {where}")
            return None
        await asyncio.sleep(0.5)


def check_cells(state: dict, result: Result) -> None:
    for c in state["cells"]:
        if c["errors"] and "raises-exception" not in c["tags"]:
            result.problems.append(f"cell {c['index']} ({first_line(c['source'])!r}) raised "
                                   + "; ".join(c["errors"]))
        elif c["count"] is None and not c["empty"]:
            result.problems.append(f"cell {c['index']} ({first_line(c['source'])!r}) never ran")


async def view_of(output):
    return await output.evaluate(VIEW_JS)


# The kernel's status changes after each move: a move's update is whole once the kernel that handled it has
# gone busy and idle again (JupyterLab hands the kernel's messages to the widgets in order, each handler
# finished before the next: the idle status comes after the update's last message), the pictures it set
# are decoded and the page has painted them.
WATCH_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel) return false;
  window.__minikvStatuses = [];
  if (window.__minikvWatched !== kernel) {
    kernel.statusChanged.connect((_, status) => window.__minikvStatuses.push(status));
    window.__minikvWatched = kernel;
  }
  return true;
}"""
SETTLED_JS = """async (el) => {
  const seen = window.__minikvStatuses || [];
  const busy = seen.indexOf('busy');
  if (busy < 0 || seen.lastIndexOf('idle') < busy || seen[seen.length - 1] !== 'idle') return false;
  await Promise.all(Array.from(el.querySelectorAll('img')).map(img => img.decode().catch(() => null)));
  await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
  return true;
}"""


async def watch_kernel(page) -> None:
    """From now on, note the kernel's status changes (call it right before a control moves)."""
    await page.evaluate(WATCH_JS)


async def wait_view(output, differs_from, timeout):
    """The view once it differs from `differs_from` and the update is whole (the kernel busy and idle again
    since `watch_kernel`, its pictures decoded and painted), or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        now = await view_of(output)
        if now != differs_from:  # changed: the rest of the update (text after picture) may still be coming
            while time.monotonic() <= deadline and not await output.evaluate(SETTLED_JS):
                await asyncio.sleep(0.05)
            return await view_of(output)
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.25)


async def move(kind: str, control, page):
    """Move `control` once; returns a coroutine function that moves it back (or None)."""
    if kind == "slider":
        value = float(await control.get_attribute("aria-valuenow"))
        top = float(await control.get_attribute("aria-valuemax"))
        key, back = ("ArrowRight", "ArrowLeft") if value < top else ("ArrowLeft", "ArrowRight")
        await control.focus()
        await control.press(key)
        if float(await control.get_attribute("aria-valuenow")) == value:
            raise RuntimeError(f"the slider at {value:g} did not move on {key}")

        async def restore():
            await control.focus()
            await control.press(back)
        return restore
    if kind == "dropdown":
        options = await control.evaluate("s => Array.from(s.options).map(o => o.value)")
        current = await control.input_value()
        if len(options) < 2:
            return None
        other = options[(options.index(current) + 1) % len(options)]
        await control.select_option(other)

        async def restore():
            await control.select_option(current)
        return restore
    if kind == "checkbox":
        await control.click()

        async def restore():
            await control.click()
        return restore
    if kind == "toggle":
        await control.click()

        async def restore():
            await control.click()
        return restore
    if kind in ("toggles", "radio"):
        items = control.locator("button" if kind == "toggles" else "input")
        n = await items.count()
        if n < 2:
            return None
        checked = "el => el.classList.contains('mod-active')" if kind == "toggles" else "el => el.checked"
        states = [await items.nth(i).evaluate(checked) for i in range(n)]
        current = states.index(True) if True in states else 0
        await items.nth((current + 1) % n).click()

        async def restore():
            await items.nth(current).click()
        return restore
    if kind == "play":
        await control.locator("button").first.click()  # play

        async def restore():
            await control.locator("button").nth(1).click()  # pause
        return restore
    raise ValueError(kind)




async def check_widgets(page, stem: str, state: dict, shots: Path, result: Result, view_timeout: float) -> None:
    # a widget view renders as a .jupyter-widgets element right inside its output (no data-mime-type)
    outputs = page.locator(".jp-OutputArea-output:has(> .jupyter-widgets)")
    expected = sum(c["widgets"] for c in state["cells"])
    n = await outputs.count()
    if n != expected:
        result.problems.append(f"{expected} widget outputs in the notebook, {n} shown in the page")
    for w in range(n):
        output = outputs.nth(w)
        await output.scroll_into_view_if_needed()
        for other in await output.evaluate(UNMOVABLE_JS):
            result.problems.append(f"widget {w + 1}: a control this test cannot move ({other})")
        moved = 0
        for kind, selector in CONTROLS.items():
            controls = output.locator(selector)
            for i in range(await controls.count()):
                control = controls.nth(i)
                if await control.evaluate("el => !!(el.disabled || el.closest('.mod-disabled'))"):
                    continue
                label = f"widget {w + 1} {kind} {i + 1}"
                await control.scroll_into_view_if_needed()
                before = await view_of(output)
                await watch_kernel(page)
                try:
                    restore = await move(kind, control, page)
                except Exception as e:  # noqa: BLE001 - one control that cannot move, the others still can
                    result.problems.append(f"{label}: could not move it: {e}")
                    continue
                if restore is None:
                    continue
                moved += 1
                after = await wait_view(output, before, view_timeout)
                if moved == 1 or after is None:  # each view once, moved, and every view that did not change
                    shot = shots / f"{stem}.w{w + 1}.{kind}{i + 1}.png"
                    await output.screenshot(path=str(shot))
                    result.screenshots.append(shot.name)
                if after is None:
                    result.problems.append(f"{label}: the view did not change in {view_timeout:.0f} s "
                                           "after the control moved")
                    result.moves.append(f"{label}: no change")
                    await restore()
                    continue
                result.moves.append(f"{label}: changed")
                await watch_kernel(page)
                await restore()
                if await wait_view(output, after, view_timeout) is None:
                    result.problems.append(f"{label}: the view did not follow the control back")
        if moved == 0:
            result.problems.append(f"widget {w + 1} has no control this test can move")


async def reopen_once(page, lab: Lab, rel: str, when: str, expected_views: int, shot: Path, result: Result) -> int:
    """Open `rel` again, wait for its views: the problems of what it shows, and how many views came back."""
    await page.evaluate(OPEN_JS, rel)
    state = await wait_shown(page, rel, views=True)
    await page.screenshot(path=str(shot))
    result.screenshots.append(shot.name)
    if state is None:
        state = await notebook_state(page, rel)
        result.problems.append(f"{when}, the outputs did not all show in {OPEN_TIMEOUT:.0f} s")
    views = sum(c["views"] for c in state["cells"]) if state else 0
    if state is not None:
        result.problems += shown_problems(state, when)
    if views != expected_views:
        result.problems.append(f"{when}, {views} of the {expected_views} views show again")
    return views


async def reopen(page, lab: Lab, nb: Path, expected_views: int, shots: Path, result: Result) -> None:
    """Save the notebook and close it; open it again while its kernel runs (the views come back live),
    then close it, shut its kernel down and open it once more, as on a learner's next day (the views
    come back from the widget state saved with it). Never "Error displaying widget: model not found"."""
    rel = nb.relative_to(ROOT).as_posix()
    if not await page.evaluate(SAVE_AND_CLOSE_JS, rel):
        result.problems.append("saved, but the notebook was not open to save")
        return
    saved = json.loads(nb.read_text())
    state_ids = set(saved["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
                    .get("state", {}))
    shown_ids = [o["data"][WIDGET_MIME]["model_id"] for c in saved["cells"] for o in c.get("outputs", [])
                 if WIDGET_MIME in o.get("data", {})]
    if missing := [i for i in shown_ids if i not in state_ids]:
        result.problems.append(f"saved, {len(missing)} of the {len(shown_ids)} widget outputs have no widget "
                               "state in the notebook's metadata.widgets (reopened, they cannot display)")
    await reopen_once(page, lab, rel, "reopened, its kernel running", expected_views,
                      shots / f"{nb.stem}.reopened-live.png", result)
    await page.evaluate(CLOSE_JS, rel)
    lab.shut_down(rel)
    result.saved_views = await reopen_once(page, lab, rel, "reopened the next day", expected_views,
                                           shots / f"{nb.stem}.reopened.png", result)
    await page.evaluate(CLOSE_JS, rel)
    lab.shut_down(rel)


async def run_notebook(browser, lab: Lab, nb: Path, shots: Path, result: Result,
                       view_timeout: float = VIEW_TIMEOUT, then_reopen: bool = False) -> None:
    """Open `nb` in a page of its own, Run All, move every control of every view (then, with
    `then_reopen`, save, close and reopen it)."""
    t0 = time.monotonic()
    rel = nb.relative_to(ROOT).as_posix()
    stem = nb.stem
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    try:
        await page.goto(f"{lab.url}/lab/workspaces/{stem}/tree/{rel}?reset&token={lab.token}")
        deadline = time.monotonic() + 120
        while True:  # the notebook open, its kernel started
            state = await notebook_state(page, rel)
            if state and state["kernel"] == "idle":
                break
            if time.monotonic() > deadline:
                result.problems.append(f"the notebook or its kernel did not start in 120 s "
                                       f"(state: {state and state['kernel']})")
                return
            await asyncio.sleep(0.5)
        state = await wait_shown(page, rel, views=True) or state  # a saved view shown, or why not
        result.problems += shown_problems(state, "on opening")
        # outputs and execution counts cleared first: Run All has finished when every cell has a count
        # again (or a cell failed, which stops it), whether the run takes a second or a minute
        await page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
        while not all(c["count"] is None for c in (await notebook_state(page, rel))["cells"]):
            if time.monotonic() > deadline:
                result.problems.append("the outputs were not cleared before Run All")
                return
            await asyncio.sleep(0.1)
        await page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        await page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        t_run = time.monotonic()
        state = await wait_run_all(page, rel, result)
        result.phases["run all"] = time.monotonic() - t_run
        shot = shots / f"{stem}.png"
        await page.screenshot(path=str(shot))
        result.screenshots.append(shot.name)
        if state is None:
            return
        check_cells(state, result)
        t_moves = time.monotonic()
        await check_widgets(page, stem, state, shots, result, view_timeout)
        result.phases["moves"] = time.monotonic() - t_moves
        state = await notebook_state(page, rel)  # a control's callback that raised into its cell
        if state:
            for c in state["cells"]:
                if c["errors"] and "raises-exception" not in c["tags"]:
                    msg = f"cell {c['index']} ({first_line(c['source'])!r}) raised " + "; ".join(c["errors"])
                    if msg not in result.problems:
                        result.problems.append(msg + " (after its widget moved)")
            if then_reopen:
                t_reopen = time.monotonic()
                await reopen(page, lab, nb, sum(c["widgets"] for c in state["cells"]), shots, result)
                result.phases["reopen"] = time.monotonic() - t_reopen
    except Exception as e:  # noqa: BLE001 - a broken page is this notebook's failure, not the run's
        result.problems.append(f"{type(e).__name__}: {e}")
    finally:
        await context.close()
        try:
            lab.shut_down(rel)
        except OSError:
            pass
        result.seconds = time.monotonic() - t0


async def open_all(browser, lab: Lab, notebooks: list[Path], results: dict[str, Result]) -> None:
    """Open each notebook in turn in one page (JupyterLab loads once)."""
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    try:
        await page.goto(f"{lab.url}/lab/workspaces/opening?reset&token={lab.token}")
        await page.wait_for_function("() => window.jupyterapp"
                                     " && window.jupyterapp.commands.hasCommand('docmanager:open')",
                                     timeout=120_000)
        await page.evaluate(NO_KERNEL_JS)
        for nb in notebooks:
            await check_opening(page, lab, nb, results[nb.stem])
    finally:
        await context.close()


async def run_browser(lab: Lab, notebooks: list[Path], harness: Path | None, selftest: Path | None,
                      shots: Path) -> dict[str, Result]:
    """In one browser, side by side: the notebooks opened one by one, the harness and the self-test run."""
    from playwright.async_api import async_playwright

    results = {p.stem: Result(p.stem) for p in [*notebooks, harness, selftest] if p is not None}
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=find_chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            jobs = []
            if harness:
                jobs.append(run_notebook(browser, lab, harness, shots, results[harness.stem], then_reopen=True))
            if selftest:
                jobs.append(run_notebook(browser, lab, selftest, shots, results[selftest.stem], 5.0))
            if notebooks:
                jobs.append(open_all(browser, lab, notebooks, results))
            await asyncio.gather(*jobs)
        finally:
            await browser.close()
    return results


# The test's own check: a notebook with one live view, one dead view (its slider moves, nothing
# else does), a cell tagged raises-exception and an error after it. The run must report exactly the
# dead view and the error, or this test could not fail.
SELFTEST_CELLS = [
    ("import ipywidgets as w\n"
     "live, shown = w.IntSlider(0, 0, 5, description='live', continuous_update=False), w.HTML('at 0')\n"
     "live.observe(lambda change: setattr(shown, 'value', f\"at {change['new']}\"), names='value')\n"
     "w.VBox([live, shown])", []),
    ("w.VBox([w.IntSlider(0, 0, 5, description='dead'), w.HTML('never changes')])", []),
    ("controls = [w.Dropdown(options=['a', 'b', 'c']), w.Checkbox(False, description='check'),\n"
     "            w.ToggleButton(False, description='toggle'), w.ToggleButtons(options=['x', 'y']),\n"
     "            w.RadioButtons(options=['p', 'q']), w.Play(0, min=0, max=100, interval=100)]\n"
     "said = w.HTML()\n"
     "def say(_=None):\n"
     "    said.value = ' '.join(str(c.value) for c in controls)\n"
     "for c in controls:\n"
     "    c.observe(say, names='value')\n"
     "say()\n"
     "w.VBox(controls + [said])", []),
    ("# saved with a view whose widget state was not saved with it\nNone", []),
    ("raise ValueError('this cell is meant to fail')", ["raises-exception"]),
    ("1 / 0", []),
]
SELFTEST_EXPECTED = [
    "on opening, an output reads as a widget's repr: 'VBox(children='",
    "on opening, cell 4 ('# saved with a view whose widget state was not saved with it') shows "
    "'Error displaying widget: model not found'",
    "cell 6 ('1 / 0') raised ZeroDivisionError: division by zero",
    "widget 2 slider 1: the view did not change in 5 s after the control moved",
]
SELFTEST_MOVES = ["widget 1 slider 1: changed", "widget 2 slider 1: no change", "widget 3 dropdown 1: changed",
                  "widget 3 checkbox 1: changed", "widget 3 toggle 1: changed", "widget 3 toggles 1: changed",
                  "widget 3 play 1: changed", "widget 3 radio 1: changed"]


def write_selftest(data_dir: Path) -> Path:
    """The self-test notebook, signed with the secret of the server's `data_dir` (trusted, as a notebook
    a learner saved in JupyterLab: its widget outputs are drawn by the widget manager)."""
    import nbformat
    from nbformat.sign import NotebookNotary

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src, metadata={"tags": tags} if tags else {})
                for src, tags in SELFTEST_CELLS]
    nb.cells[1].outputs = [nbformat.v4.new_output(  # the dead view, saved as ipywidgets would save it
        "execute_result", {"text/plain": "VBox(children=(IntSlider(value=0, description='dead', max=5), HTML(..)))"},
        execution_count=2)]
    nb.cells[3].outputs = [nbformat.v4.new_output(  # a view whose model is nowhere: "model not found"
        "execute_result", {WIDGET_MIME: {"model_id": "0" * 32, "version_major": 2, "version_minor": 0},
                           "text/plain": "[interactive view]"}, execution_count=4)]
    data_dir.mkdir(parents=True, exist_ok=True)
    NotebookNotary(data_dir=str(data_dir)).sign(nb)
    path = WORK / "selftest.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def harness_copy() -> Path:
    """The harness as a learner's copy: this test saves it, the repository's stays as it is."""
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / HARNESS.name
    shutil.copyfile(HARNESS, path)
    return path


@pytest.fixture(scope="module")
def browser_run(tmp_path_factory, request):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    # what this session checks (all, unless -k picked some)
    names = {getattr(item, "originalname", None) for item in request.session.items}
    chosen = {item.callspec.params["nb"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_notebook_opens_with_its_outputs"}
    notebooks = [nb for nb in NOTEBOOKS if nb in chosen]
    harness = harness_copy() if names & {"test_every_view_answers_its_controls",
                                         "test_saved_views_show_again_after_reopening",
                                         "test_browser_saved_only_the_harness"} else None
    tmp = tmp_path_factory.mktemp("jupyterlab")
    selftest = write_selftest(tmp / "data") if "test_browser_test_can_fail" in names else None
    shots = Path(os.environ.get("MINIKV_SCREENSHOTS") or ROOT / ".pytest_cache" / "browser")
    shots.mkdir(parents=True, exist_ok=True)
    for old in shots.glob("*.png"):
        old.unlink()
    lab = start_lab(tmp)
    t0 = time.monotonic()
    try:
        results = asyncio.run(run_browser(lab, notebooks, harness, selftest, shots))
    finally:
        stop_lab(lab)
    total = time.monotonic() - t0
    saved = [ln for ln in lab.log.read_text(errors="replace").splitlines() if "Saving file" in ln]
    lines = [f"{r.name:34s} {r.seconds:6.1f} s  {r.shown} outputs shown, {len(r.moves)} moves, "
             f"{len(r.problems)} problems"
             + "".join(f", {k} {v:.1f} s" for k, v in r.phases.items()) for r in results.values()]
    lines.append(f"{'all, side by side':34s} {total:6.1f} s (load average {os.getloadavg()[0]:.1f})")
    lines += [f"{r.name}: {problem}" for r in results.values() for problem in r.problems]
    (shots / "times.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results, saved


@pytest.mark.slow
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_opens_with_its_outputs(nb, browser_run, request):
    """Opened in JupyterLab (no kernel run), the notebook shows every stored output, none broken."""
    if nb.stem in KNOWN_BROKEN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_BROKEN[nb.stem], strict=False))
    results, _ = browser_run
    r = results[nb.stem]
    assert not r.problems, f"{nb.name} opened in JupyterLab ({r.seconds:.0f} s):\n  " + "\n  ".join(r.problems)
    assert r.shown, (f"{nb.name} opened in JupyterLab shows no output: the course's notebooks are kept with their "
                     "outputs, for reading before running (execute it and keep its outputs)")


@pytest.mark.slow
def test_every_view_answers_its_controls(browser_run):
    """The harness, Run All'd: every control of every view moves it, and the view follows it back."""
    results, _ = browser_run
    r = results[HARNESS.stem]
    problems = [p for p in r.problems if not p.startswith(("saved", "reopened"))]
    assert not problems, f"{HARNESS.name} in JupyterLab ({r.seconds:.0f} s):\n  " + "\n  ".join(problems)
    assert r.moves, "no control moved"


@pytest.mark.slow
def test_saved_views_show_again_after_reopening(browser_run):
    """Saved with `make lab`'s settings, closed, its kernel shut down and reopened, the harness shows
    every view again from its saved widget state: no "Error displaying widget: model not found"."""
    results, _ = browser_run
    r = results[HARNESS.stem]
    problems = [p for p in r.problems if p.startswith(("saved", "reopened"))]
    assert not problems and r.saved_views, "\n  ".join(problems or ["no view shown after reopening"])


@pytest.mark.slow
def test_browser_test_can_fail(browser_run):
    """On a notebook made to fail, the run names the widget repr, the view whose state was not saved,
    the error and the dead widget, and nothing else."""
    results, _ = browser_run
    r = results["selftest"]
    assert r.problems == SELFTEST_EXPECTED, r.problems
    assert r.moves == SELFTEST_MOVES, r.moves  # every kind of control moved, each view answered


@pytest.mark.slow
def test_browser_saved_only_the_harness(browser_run):
    """Autosave is off here: the one file saved is the harness's copy, never a notebook of the repository."""
    _, saved = browser_run
    copy = "/" + (WORK / HARNESS.name).relative_to(ROOT).as_posix()  # as the server logs it, from its root
    others = [ln for ln in saved if not ln.endswith(copy)]
    assert saved and not others, "JupyterLab saved files other than the harness copy:\n" + "\n".join(others or saved)


# ---------------------------------------------------------------------------------------------
# no browser needed


def course_views() -> dict[str, str]:
    """The ipywidgets views of minikv.viz: function name -> module (a function that builds ipywidgets)."""
    import minikv.viz

    views = {}
    for info in pkgutil.iter_modules(minikv.viz.__path__):
        module = importlib.import_module(f"minikv.viz.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if (fn.__module__ == module.__name__ and not name.startswith("_")
                    and "import ipywidgets" in inspect.getsource(fn)):
                views[name] = module.__name__
    return views


def called_names(nb: Path) -> set[str]:
    """Every name a code cell of `nb` calls (f(...) or x.f(...))."""
    names = set()
    for cell in json.loads(nb.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        source = "\n".join("pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call):
                f = node.func
                names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_every_course_view_is_in_the_harness():
    """Every minikv.viz view a notebook builds is built by the browser test's harness too, so that no
    view reaches learners without its controls moved in a real browser."""
    views = course_views()
    assert {"pool_widget", "kv_calculator", "question_browser"} <= set(views), views  # the finder finds them
    used = {name: nb.name for nb in NOTEBOOKS for name in called_names(nb) & set(views)}
    missing = {name: f"{views[name]}, called in {where}" for name, where in used.items()
               if name not in called_names(HARNESS)}
    assert used and not missing, ("views the notebooks build but tests/browser/widgets.ipynb does not (add a "
                                  f"cell that builds each on small inputs): {missing}")


def test_make_lab_saves_widget_state_and_runs_kernels_on_one_thread():
    """`make lab`: its settings make the widget manager save widget state (a saved notebook reopens with
    its views), its kernels get one torch thread unless OMP_NUM_THREADS is set, and it opens a copy."""
    env, args = make_lab_command()
    overrides = json.loads((lab_settings_dir() / "overrides.json").read_text())
    assert overrides["@jupyter-widgets/jupyterlab-manager:plugin"]["saveState"] is True
    assert "OMP_NUM_THREADS" in env, f"`make lab` leaves OMP_NUM_THREADS to torch (all cores): {env}"
    for given, expected in ((None, "1"), ("3", "3")):  # as the shell running the recipe reads it
        shell_env = ({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
                     | ({"OMP_NUM_THREADS": given} if given else {}))
        said = subprocess.run(["sh", "-c", f'echo {env["OMP_NUM_THREADS"]}'], env=shell_env,
                              capture_output=True, text=True)
        assert said.stdout.strip() == expected, (given, env["OMP_NUM_THREADS"], said.stdout)
    opened = [a for a in args if a.endswith(".ipynb")]
    assert opened and not opened[0].startswith("notebooks/"), f"`make lab` opens a tracked notebook: {opened}"


def test_skips_without_chromium(tmp_path):
    """A learner's machine without Chromium: the browser tests skip, say why, and pytest passes."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MINIKV_CHROMIUM", "PYTEST_ADDOPTS") and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["PATH"] = str(tmp_path)  # no chromium anywhere on it
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--noconftest", "-W", "ignore::pytest.PytestUnknownMarkWarning",  # (no torch to import)
                          str(Path(__file__)), "-k", "00_tour or can_fail or answers_its_controls"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"\b3 skipped\b", out), out
    assert "Chromium is not installed" in out, out


def test_skip_reason_without_playwright(monkeypatch):
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "playwright", None)  # import playwright now raises ImportError
        m.setitem(sys.modules, "playwright.async_api", None)
        assert unavailable_reason().startswith("Playwright for Python is missing")
    if importlib.util.find_spec("playwright") is not None:
        monkeypatch.setenv("MINIKV_CHROMIUM", "")  # set and empty: no browser
        assert unavailable_reason().startswith("Chromium is not installed")


@pytest.mark.parametrize("case", ["root, apt-get installs", "root, apt-get fails", "not root", "make fails"])
def test_ci_run_installs_chromium_or_goes_on(tmp_path, case):
    """.ci/run installs Chromium when it can, always runs `make test`, and fails only when make does."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("dirname", "timeout"):
        (bin_ / tool).symlink_to(shutil.which(tool))
    calls = tmp_path / "calls"

    def fake(name, body):
        (bin_ / name).write_text(f"#!{shutil.which('bash')}\necho {name} \"$@\" >> {calls}\n{body}\n")
        (bin_ / name).chmod(0o755)

    fake("id", "echo 1000" if case == "not root" else "echo 0")
    fake("make", "exit 2" if case == "make fails" else "exit 0")
    installs = (f"if [ \"$1\" = install ]; then printf '#!/bin/sh\\n' > {bin_}/chromium; "
                f"{shutil.which('chmod')} +x {bin_}/chromium; fi")
    fake("apt-get", "exit 100" if case == "root, apt-get fails" else installs)
    run = subprocess.run([shutil.which("bash"), str(ROOT / ".ci" / "run")], env={"PATH": str(bin_)},
                         capture_output=True, text=True, timeout=60)
    log = calls.read_text()
    assert "make test" in log, (log, run.stderr)
    assert run.returncode == (2 if case == "make fails" else 0), run.stderr
    if case == "not root":
        assert "apt-get" not in log and "cannot be installed here" in run.stderr
    elif case == "root, apt-get fails":
        assert "could not install chromium" in run.stderr
    else:
        assert "apt-get install -y -qq --no-install-recommends chromium" in log, log
        assert (bin_ / "chromium").exists() and not run.stderr
