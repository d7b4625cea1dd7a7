"""Sphinx configuration of te_adapters's documentation: the API reference (autodoc, napoleon for
the Google-style docstrings) and the Markdown pages (myst-parser).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (``.ci/run`` does, with
warnings as errors). The package is imported from the source tree (this folder's parent) or from
an install.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import te_adapters  # noqa: E402

project = "te_adapters"
author = "te_adapters contributors"
copyright = "te_adapters contributors"  # noqa: A001
release = te_adapters.__version__
version = release

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
  "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Google-style sections (Args, Returns, Raises, Example) as the package writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections as fields of the class (autodoc also documents each attribute itself).
napoleon_use_ivar = True
autodoc_default_options = {
  "members": True,
  "member-order": "bysource",
  "show-inheritance": True,
  "undoc-members": False,
}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
# Classes: the class docstring and __init__'s arguments together.
autoclass_content = "both"
myst_heading_anchors = 3
# The Markdown pages link to files of the repository that are not part of the documentation.
suppress_warnings = ["myst.xref_missing"]

html_theme = "alabaster"
html_title = f"te_adapters {release}"
