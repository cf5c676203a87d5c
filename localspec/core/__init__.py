"""The core both front ends keep pairs through, below them and above the API.

* :mod:`.pairs`: what a call asks for, a typed pair spec (files by identity, load options);
* :mod:`.calls`: one typed, versioned request and the events that answer it;
* :mod:`.status`: the one status type of what is loaded (``ps``, ``info``, ``/health``);
* :mod:`.wire`: the one validator (pydantic) of what a process reads from another over the
  resident socket: a call, a cancel, a stop, a status;
* :mod:`.residency`: the owner of what is loaded (pairs, profiles, prompt caches, a queue per
  pair, cancellation);
* :mod:`.run`: a request run on a residency (the resident service's, or this process's).

The first three are the standard library and localspec's leaf modules only: the ``localspec``
client makes and reads them.
"""
