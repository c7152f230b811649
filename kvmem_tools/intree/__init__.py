"""The in-tree feature branch: vllm-kvmem's features as a patch series for
vLLM's own tree, one reviewable PR per patch (``python -m kvmem_tools.intree``).

Each patch (``patches/``) holds the code as vLLM's engineers would write it:
anchored edits of vLLM's own modules and tests, and the files it adds
(``files/<name>/``, in vLLM's layout; ``files/<name>/appended/`` holds the
tests it appends to an existing test file of vLLM, at the same path).
``series.write_series`` applies them to the vLLM tree it is given, commits
each in a scratch git repository and writes the series with ``git
format-patch``; nothing of vLLM's is stored here.
"""
