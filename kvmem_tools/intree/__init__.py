"""The in-tree feature branch: vllm-kvmem's features as a patch series for
vLLM's own tree, one reviewable PR per patch (``python -m kvmem_tools.intree``).

Each patch (``patches/``) holds the code as vLLM's engineers would write it:
anchored edits of vLLM's own modules and the files it adds (``files/``,
tests in vLLM's layout). ``series.write_series`` applies them to the vLLM
tree it is given, commits each in a scratch git repository and writes the
series with ``git format-patch``; nothing of vLLM's is stored here.
"""
