"""A pytest plugin for running llama.cpp's server suite (tools/server/tests) against
dflash-server through the launcher: the suite's session fixture downloads every preset's
model from the HF hub, which this machine cannot reach and the launcher does not need
(it maps every model to the bundled demo pair), so that step is a no-op; `wget` (imported
by the suite's utils.py for downloads the in-scope tests never make) is a stub."""
import sys
import types


def _no_download(*args, **kwargs):
    raise RuntimeError("no downloads when running llama.cpp's suite against dflash-server")


if "wget" not in sys.modules:
    try:
        import wget  # noqa: F401
    except ImportError:
        sys.modules["wget"] = types.SimpleNamespace(download=_no_download)


def pytest_configure(config):
    import utils  # the suite's own, from its rootdir (tests/ is on sys.path by its conftest)

    utils.ServerPreset.load_all = staticmethod(lambda: None)
    # a file the suite would download (a draft model) is named, not fetched: the launcher
    # maps every model to the demo pair and never opens it
    utils.download_file = lambda url, output_file_path=None: output_file_path or f"./tmp/{url.split('/').pop()}"
