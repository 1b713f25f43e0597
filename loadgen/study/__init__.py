"""Portability study and SageSched evaluation in simulation (`sagesched study`)."""
