"""Discrete-event scale simulator: the real buffer and role loops on a virtual clock."""

from jaxrl_async.sim.profile import Profile, load_profile, profile_from_dict, save_profile
from jaxrl_async.sim.simulator import SimResult, simulate

__all__ = ["Profile", "SimResult", "load_profile", "profile_from_dict", "save_profile",
           "simulate"]
