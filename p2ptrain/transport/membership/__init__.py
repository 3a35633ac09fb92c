"""Who the members are: views (who trains together when), liveness (alive / lagging / dead) and the
Hello protocol that carries both, behind one object (membership.Membership)."""
from p2ptrain.transport.membership.greetings import ClusterSurvey
from p2ptrain.transport.membership.identity import PROTOCOL_VERSION, Identity
from p2ptrain.transport.membership.liveness import DEFAULT_MAX_LAG
from p2ptrain.transport.membership.membership import Membership
from p2ptrain.transport.membership.views import DEFAULT_VIEW_MARGIN, View

__all__ = ["ClusterSurvey", "DEFAULT_MAX_LAG", "DEFAULT_VIEW_MARGIN", "Identity", "Membership", "PROTOCOL_VERSION",
           "View"]
