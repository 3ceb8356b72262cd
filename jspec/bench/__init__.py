"""`jspec bench`: step costs against the HBM roofline, on real-size random-weight models."""
