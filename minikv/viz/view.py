"""A widget that still reads well where no kernel runs it.

A saved notebook keeps, for each widget output, a reference to the live widget and a fallback for
viewers that cannot show it: JupyterLab before the cell is run again (an untrusted notebook), GitHub,
nbviewer. ipywidgets' own fallback is the widget's repr, `VBox(children=(IntSlider(value=0, ...`.
`view` builds the same VBox with a fallback a reader can use instead:

    text/plain   a sentence saying what the widget shows and that running the cell makes it live,
                 followed by the widget's current answer in words (when it has one)
    image/png    the widget's current picture (when it has one): viewers pick it before the text

In a running kernel nothing changes: the live widget is shown and answers its controls.
"""
from __future__ import annotations

import base64
from collections.abc import Callable, Sequence

_VIEW_CLASS = None


def _view_class():
    global _VIEW_CLASS
    if _VIEW_CLASS is None:
        import ipywidgets as w

        class View(w.VBox):
            """A VBox whose saved fallback is `fallback()`: (text, png bytes or None)."""

            def __init__(self, children, fallback: Callable[[], tuple[str, bytes | None]], **kwargs):
                super().__init__(children, **kwargs)
                self._fallback = fallback

            def __repr__(self) -> str:
                return self._fallback()[0]

            def _repr_mimebundle_(self, **kwargs):
                data = super()._repr_mimebundle_(**kwargs)  # the live view and ipywidgets' repr
                text, png = self._fallback()
                data["text/plain"] = text
                if png:
                    data["image/png"] = base64.b64encode(png).decode("ascii")
                return data

        View.__qualname__ = "View"
        _VIEW_CLASS = View
    return _VIEW_CLASS


def view(children: Sequence, what: str, details: Callable[[], str] | None = None,
         picture: Callable[[], bytes | None] | None = None):
    """A VBox of `children` whose saved fallback says `what` it is, then `details()` (the widget's
    current answer in words) and `picture()` (its current PNG), both read when the cell's output is made."""

    def fallback() -> tuple[str, bytes | None]:
        text = f"[interactive view: {what}. Run this cell to use its controls.]"
        if details is not None:
            text += "\n" + details()
        return text, picture() if picture is not None else None

    return _view_class()(list(children), fallback)
