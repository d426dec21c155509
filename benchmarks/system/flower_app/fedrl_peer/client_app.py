"""The ClientApp: a train message's arrays go back unchanged (no training, like the federation's
zero local steps), with the example count FedAvg weighs by."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays: ArrayRecord = msg.content["arrays"]
    reply = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
    return Message(content=reply, reply_to=msg)
