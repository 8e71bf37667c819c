from mooncake._fast._verbs_device import Context
from mooncake._fast._verbs_lib import Resource

class PD(Resource):
    context: Context
    def __init__(self, context: Context) -> None: ...
