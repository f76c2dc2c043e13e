"""Tree helpers the tree tests share: a parents list's root paths."""


def root_path(parents, i):
    """The nodes from the root to node i, root first."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]
