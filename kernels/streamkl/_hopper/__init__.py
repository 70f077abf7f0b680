"""Warp-group (sm_90) kernels written in Gluon, which compute what the portable Triton kernels compute, faster where
:mod:`streamkl.dispatch` selects them (its table says where, and why):

* :mod:`.forward`: the forward (KL and both log-sum-exps), TMA loads and both score products of the next key tile in
  flight during the exponentials of this one;
* :mod:`.fused_forward`: the training forward of a frozen teacher (also the student's query gradient), a producer warp
  and two consumer warpgroups; bitwise the portable training forward;
* :mod:`.backward`: the key pass of a frozen teacher's backward (the student's key gradient), one warpgroup, its
  full steps pipelined or one at a time; :mod:`.key_pass_ws`, the same pass warp-specialised; :mod:`.key_pass_tiles`,
  the pieces both share.

They import Gluon's Hopper API, which differs between Triton releases: the dispatch imports them only when it selects
one, and treats a module that does not import as absent. Nothing here imports :mod:`streamkl._triton`; what both
share is in :mod:`streamkl._triton_common`.
"""
