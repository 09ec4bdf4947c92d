# widgets.ipynb is the browser test's harness (tests/test_browser.py runs it in JupyterLab), not a
# lesson: nbval must not collect it (it stores no outputs to compare).
collect_ignore_glob = ["*.ipynb"]
