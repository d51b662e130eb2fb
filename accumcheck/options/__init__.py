"""The one specification of accumcheck's options, shared by the command line, the pytest plugin
and the Python API.

One ``Option`` describes one setting for every way in: ``add_to(add_argument, prefix)`` puts it on
an argparse parser (``accumcheck``'s subcommands) or a pytest option group (``--accum-*``), the
way pytest-benchmark's ``add_display_options(addoption, prefix)`` does, and ``validate`` checks
the same setting given as a Python value (``accumcheck.compare(...)``). A value is parsed and
checked by the same rule on every path, and a bad one is told in one line: what was wrong and
what to write instead. ``RUN_OPTIONS`` lists a comparison's options; ``command_line`` rebuilds
the command that reruns one from a report's record of them. This package imports nothing heavy:
the pytest plugin reads it at every pytest start.

Three modules: ``choices`` (the values a setting may take), ``values`` (the rules a value is
read by) and ``spec`` (the options themselves, and the commands that rerun a run).
"""
