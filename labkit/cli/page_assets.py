"""The style and script the built pages add to what the chapters render: the
site (labkit/cli/site.py) and the slide decks (vendor.py's deck template).

Imports labkit.viz (LIVE_CLASS) only.

A widget on a static page is a snapshot of the run that built it: controls drawn
ahead (LIVE_CLASS) keep working in the browser, the others are disabled, and a
line atop the widget says which is which.
"""

from __future__ import annotations

from labkit.viz import LIVE_CLASS

SNAPSHOT_NOTE = ("Snapshot of the run that built this page: run the chapter in "
                 "JupyterLab (make lab) to move these controls.")
PARTLY_LIVE_NOTE = ("Drawn when this page was built: the outlined controls work "
                    "here; run the chapter in JupyterLab (make lab) to move the "
                    "others.")

# the outermost widget of each output: controls not drawn ahead disabled, a
# line atop it
SNAPSHOT_JS = """\
(function () {
  var NOTE = %r, PARTLY = %r, LIVE = %r;
  var CONTROLS = "input, select, button, textarea, .noUi-target";
  function mark(root) {
    if (root.dataset.labkitSnapshot) { return; }
    var controls = root.querySelectorAll(CONTROLS);
    if (!controls.length) { return; }
    root.dataset.labkitSnapshot = "1";
    root.classList.add("labkit-snapshot");
    var live = 0;
    controls.forEach(function (c) {
      if (c.closest("." + LIVE)) { live += 1; return; }
      c.setAttribute("disabled", "");
      c.setAttribute("aria-disabled", "true");
      c.setAttribute("tabindex", "-1");
    });
    var badge = document.createElement("div");
    badge.className = "labkit-snapshot-badge";
    badge.textContent = live ? PARTLY : NOTE;
    // inside the widget's own column: its parent may lay children in a row
    // or a table (a deck puts the Out[] prompt beside it)
    root.insertBefore(badge, root.firstChild);
  }
  function scan() {
    document.querySelectorAll(".jupyter-widgets").forEach(function (w) {
      if (!w.parentElement.closest(".jupyter-widgets")) { mark(w); }
    });
  }
  var pending = null;  // one scan per burst of changes (MathJax makes thousands)
  function later() {
    if (pending === null) {
      pending = setTimeout(function () { pending = null; scan(); }, 250);
    }
  }
  new MutationObserver(later).observe(document.documentElement,
                                      {childList: true, subtree: true});
  document.addEventListener("DOMContentLoaded", scan);
  later();
})();
""" % (SNAPSHOT_NOTE, PARTLY_LIVE_NOTE, LIVE_CLASS)

_SNAPSHOT_CSS = """\
.labkit-snapshot-badge {
  font-size: 0.8em; color: #6a4a00; background: #fff4d6;
  border-left: 3px solid #e0a800; padding: 0.2em 0.6em; margin: 0.3em 0;
}
.labkit-snapshot :is(.widget-slider, .widget-dropdown, .widget-toggle-buttons,
  .widget-button, .widget-play, .widget-checkbox, .widget-radio, .widget-text,
  .noUi-target):not(.%(live)s, .%(live)s *) {
  pointer-events: none; opacity: 0.6;
}
.labkit-snapshot .%(live)s {
  outline: 2px solid #e0a800; outline-offset: 2px; border-radius: 3px;
}
""" % {"live": LIVE_CLASS}

SITE_CSS = _SNAPSHOT_CSS + """\
/* code wraps at the column instead of scrolling sideways, on screen and paper */
article pre, div.cell div.highlight pre, div.cell_output pre, div.output pre {
  white-space: pre-wrap; overflow-wrap: anywhere;
}
/* a slider needs room for its track beside its label; a row of controls
   wider than the column wraps */
.widget-slider .slider-container { min-width: 6em; flex: 1 1 auto; }
.jupyter-widgets.widget-hbox { flex-wrap: wrap; row-gap: 0.3em; }
/* a column a chart fits at 1280 px (labkit.viz.style's PAGE_WIDTH_IN, 7.6
   in at 100 dpi: 771 px) at 97.5 % of its size or more, so its smallest text,
   7.5 pt, stays over 10 px: the contents panel a little narrower (17rem ->
   15rem, a long name in it wraps) and the article's side padding halved */
:root { --pst-sidebar-secondary: 15rem; }
.bd-sidebar-secondary code, .bd-sidebar-secondary code span {
  overflow-wrap: anywhere; white-space: normal;
}
.bd-main .bd-content .bd-article-container .bd-article {
  padding-left: 1rem; padding-right: 1rem;
}
/* a lecturer's speaker notes, set apart from the chapter's text */
div.admonition.labkit-notes { font-size: 0.9em; opacity: 0.9; }
"""

DECK_CSS = _SNAPSHOT_CSS + """\
.reveal pre, .reveal .highlight pre, .reveal .jp-OutputArea-output pre {
  white-space: pre-wrap; overflow-wrap: anywhere;
}
.reveal .jp-RenderedHTMLCommon p, .reveal .jp-RenderedHTMLCommon li {
  font-size: 24px; line-height: 1.35;
}
.reveal .jp-RenderedHTMLCommon table { font-size: 18px; }
.reveal .highlight pre, .reveal .jp-OutputArea-output pre { font-size: 15px; }
.reveal .labkit-snapshot-badge { font-size: 16px; }
"""

# after reveal.js is up: the tall slides of the slide shown scroll, from the first
# (reveal's own hook runs only when the slide changes)
DECK_JS = """\
require(["%s/dist/reveal.js"], function (Reveal) {
  function fit() {
    var h = document.querySelector(".reveal").offsetHeight * 0.95;
    document.querySelectorAll("section.present section").forEach(function (s) {
      if (s.scrollHeight > h) {
        s.style.height = "95vh";
        s.style.overflowY = "auto";
        s.style.marginTop = "20px";
      }
    });
  }
  if (Reveal.isReady()) { fit(); } else { Reveal.on("ready", fit); }
  Reveal.on("slidechanged", fit);
  window.addEventListener("load", fit);
  setTimeout(fit, 1500);  // after MathJax and the widgets have drawn
});
"""
