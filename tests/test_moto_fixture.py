import botocore.exceptions
import pytest


def test_moto_refuses_a_request_signed_with_the_wrong_secret(moto, bucket):
    moto.client().put_object(Bucket=bucket, Key="a", Body=b"x")
    with pytest.raises(botocore.exceptions.ClientError) as err:
        moto.client(secret_key="wrong").get_object(Bucket=bucket, Key="a")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert moto.client().get_object(Bucket=bucket, Key="a")["Body"].read() == b"x"
