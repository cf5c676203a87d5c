"""Resident models: a ``localspec`` call leaves its models loaded in a background service, and
later calls with the same models and settings are served by it.

* :mod:`.protocol`: the frames a client and a service exchange on a Unix socket (stdlib only);
* :mod:`.runtime`: where services live (a private per-user directory), their records, keys and
  the peer-credential check (stdlib only);
* :mod:`.client`: the ``localspec`` entry point: forwards a call to a matching service, starts
  one, or runs the call in this process (``--keep-alive 0``); imports no heavy module;
* :mod:`.control`: what ``localspec ps`` and ``localspec stop`` ask of services;
* :mod:`.service`: the background process: runs the command line's own commands on models it
  keeps loaded, with the client's stdin, stdout, stderr, signals and exit status.
"""
