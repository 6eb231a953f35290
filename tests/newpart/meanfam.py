"""The family line of the new mixer: llama's layers with the causal mean in place of attention."""
from meshlm.models.family import Family, Kind
from meshlm.models.ffns.glu import glu

from newpart.mean_mixer import causal_mean

FAMILY = Family("meanfam", kinds={"dense": Kind(causal_mean(), glu())})
